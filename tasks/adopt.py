"""Adoption: take checkpoint directories Rewind did not write under protection (hash, manifest, register)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task

from infra.errors import ConfigError
from infra.format import manifest as mf
from infra.inventory.adopt import adopt
from tasks.common import RETRY, catalog, emit


@task(name="find-unadopted")
def find_unadopted(path: str, pattern: str = "checkpoint-*") -> list[str]:
    """``path`` itself when it is a checkpoint directory, else its sub-directories matching ``pattern``
    that hold no Rewind manifest yet, oldest step first."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory")
    if not any(p.is_dir() for p in root.iterdir()):
        return [] if (root / mf.MANIFEST_NAME).exists() else [str(root)]
    found = [p for p in root.glob(pattern) if p.is_dir() and not (p / mf.MANIFEST_NAME).exists()]
    return [str(p) for p in sorted(found, key=lambda p: (len(p.name), p.name))]


@task(name="adopt-checkpoint", **RETRY)
def adopt_checkpoint(path: str, run: str, step: int | None = None, fmt: str | None = None) -> dict[str, Any]:
    """Adopt one directory; running it again on the same directory changes nothing."""
    got = adopt(catalog(), Path(path), run=run, step=step, fmt=fmt)
    result = asdict(got)
    if got.action == "adopted":
        emit("rewind.checkpoint.adopted", run, result, step=got.step, checkpoint_id=got.checkpoint_id)
    return result
