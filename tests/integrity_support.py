"""Small helpers the integrity tests share: damage a file, read back what the catalog says."""

from __future__ import annotations

from pathlib import Path

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog


def flip(path: Path) -> None:
    """Flip one bit in the middle of a file, behind Rewind's back."""
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x10
    path.write_bytes(bytes(b))


def statuses(run: str) -> dict[int, str]:
    """Status of every checkpoint of ``run`` by step (the newest row per step)."""
    return {c.step: str(c.status) for c in lineage.checkpoints(Catalog(), run)}


def copy_statuses(run: str, step: int) -> dict[str, str]:
    """Status of every copy of the current checkpoint at ``step``, by tier."""
    cat = Catalog()
    (ck,) = [c for c in lineage.checkpoints(cat, run, step) if c.status not in ("superseded", "aborted")]
    return {r.tier: str(r.status) for r in lineage.replicas_of(cat, ck.id)}
