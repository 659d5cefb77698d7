"""Byte counts for people: one way to print them (binary units, as `ls -h` and `du -h` do), one to read them."""

from __future__ import annotations

import re

from rewind.infra.errors import ConfigError


def human(n: float) -> str:
    """``945 B``, ``1.5 KiB``, ``2.0 GiB``, ``3.1 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20}
_UNITS |= {"g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse(text: str, *, what: str = "size") -> int:
    """``"200MiB"``, ``"1.5GB"``, ``"500M"``, ``"1048576"`` -> bytes (decimal and binary units, any case)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{what}: {text!r} is not a size (e.g. 200MiB, 1.5GB, 500M)")
    return int(float(m.group(1)) * _UNITS[unit])
