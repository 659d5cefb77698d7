"""Keeping secrets out of what Rewind records: command lines and URLs, before they reach a manifest,
a catalog row, an incident or an off-site copy.

A flag whose name says it carries a secret (``--token=...``, ``--password X``,
``--api-key``...), an environment-style ``NAME=value`` whose name says so, and the
user:password part of a URL are replaced by ``<redacted>``. Secrets belong in the
environment or in files, never in flags; this is the net under that rule.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

HIDDEN = "<redacted>"
_SECRET_NAME = re.compile(
    r"token|passw|secret|api[-_]?key|access[-_]?key|private[-_]?key|auth|credential|cookie", re.I
)
_URL_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def text(value: str) -> str:
    """``value`` with the user:password part of any URL in it hidden."""
    return _URL_USERINFO.sub(rf"\1{HIDDEN}@", value)


def argv(args: Sequence[str]) -> list[str]:
    """A command line with every secret-looking value hidden (the flags themselves stay, for the reader)."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(HIDDEN)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if _SECRET_NAME.search(name) and (arg.startswith("-") or (eq and name.replace("_", "").isalnum())):
            if eq:
                out.append(f"{name}={HIDDEN}")
            else:
                out.append(arg)
                hide_next = arg.startswith("-")
            continue
        out.append(text(arg))
    return out
