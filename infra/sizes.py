"""Byte counts for people: one way to print them (binary units, as `ls -h` and `du -h` do)."""

from __future__ import annotations


def human(n: float) -> str:
    """``945 B``, ``1.5 KiB``, ``2.0 GiB``, ``3.1 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
