"""Plain-text output of the ``rewind`` CLI: aligned tables for people (``--json`` is for programs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)
