"""Byte progress of long work (replicate, restore, deep verify, gc): reported here, drawn elsewhere.

infra never draws. Long work opens a *phase* (what, total bytes) and advances it as bytes
are hashed, sent, fetched or freed; whoever watches is chosen by the caller for the
current context with ``watching(meter)``: the CLI draws a terminal bar or plain lines
(``flows/progress_view.py``), a Prefect task keeps a progress artifact up to date
(``tasks/progress.py``). With nobody watching, a report costs one context-variable
lookup per chunk (8 MiB), so the hot paths report unconditionally.

Worker threads do not inherit the context: code that fans out captures ``current()``
first and advances that meter from its threads (every ``Meter`` is thread-safe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol


class Meter(Protocol):
    def begin(self, what: str, total: int) -> None:
        """A new phase of ``total`` bytes starts (the previous one, if any, has ended)."""
        ...

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the current phase are done; safe to call from any thread."""
        ...

    def end(self) -> None:
        """The current phase is over, complete or not."""
        ...


_watcher: ContextVar[Meter | None] = ContextVar("rewind_progress", default=None)


def current() -> Meter | None:
    """The meter watching this context, to hand to worker threads (None: nobody watches)."""
    return _watcher.get()


@contextlib.contextmanager
def watching(meter: Meter) -> Iterator[Meter]:
    """Report the progress of everything run inside the block to ``meter``."""
    token = _watcher.set(meter)
    try:
        yield meter
    finally:
        _watcher.reset(token)


@contextlib.contextmanager
def phase(what: str, total: int) -> Iterator[None]:
    """One stretch of byte work, shown as one bar or one series of lines (nothing to show for 0 bytes)."""
    meter = _watcher.get()
    if meter is None or total <= 0:
        yield
        return
    meter.begin(what, total)
    try:
        yield
    finally:
        meter.end()


def advance(nbytes: int) -> None:
    """``nbytes`` of the current phase are done (hashed, written, sent, freed)."""
    meter = _watcher.get()
    if meter is not None and nbytes > 0:
        meter.advance(nbytes)
