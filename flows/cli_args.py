"""Argument types and the parser of the ``rewind`` CLI: bad input is one line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

MAX_STEP = 2**63 - 1  # what the catalog's BIGINT holds
# What each command module's ``register`` is handed by flows/cli.py: ``add`` makes a subcommand, ``wrap``
# binds a command to the shared ``emit`` (text or --json) and ``catalog`` (opened on first use).
Emit = Callable[..., None]
OpenCatalog = Callable[[], Any]
Add = Callable[..., argparse.ArgumentParser]
Wrap = Callable[[Callable[..., int]], Callable[[argparse.Namespace], int]]

# Exit codes: a check found problems, bad input or state, something unreachable right now, a bug.
EXIT_FINDINGS, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERNAL = 1, 2, 3, 70


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is the one line ``rewind: error: ...`` (exit 2), like every other error."""

    def error(self, message: str) -> NoReturn:
        print(f"rewind: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def step(text: str) -> int:
    """A training step: a whole number from 0 to 2**63-1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is a whole number, not {text!r}") from None
    if not 0 <= n <= MAX_STEP:
        raise argparse.ArgumentTypeError(f"a step is between 0 and {MAX_STEP}, not {text}")
    return n


def count(text: str) -> int:
    """A count: a whole number from 0 up."""
    n = step(text)
    return n


def at_least_one(text: str) -> int:
    """A count from 1 up (how many rows to show)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if not 1 <= n <= MAX_STEP:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to {MAX_STEP}, not {text}")
    return n


MAX_AMOUNT = 1e12  # seconds (31,000 years), gigabytes (a zettabyte), dollars: larger is a typo, not a wish


def amount(text: str) -> float:
    """A finite, non-negative number (seconds, gigabytes, dollars, a share), at most ``MAX_AMOUNT``."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not math.isfinite(x) or not 0 <= x <= MAX_AMOUNT:
        raise argparse.ArgumentTypeError(f"expected a finite number from 0 to {MAX_AMOUNT:g}, not {text}")
    return x


def whole(low: int, high: int) -> Callable[[str], int]:
    """An argument type: a whole number from ``low`` to ``high`` (e.g. S3's limits)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, not {text}")
        return n

    return parse
