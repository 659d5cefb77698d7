"""Adoption: take checkpoint directories Rewind did not write under protection (hash, manifest, register)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task

from rewind.infra.inventory.adopt import adopt, pending
from rewind.infra.phases.notify import run_event
from rewind.tasks.common import RETRY, catalog, notifier


@task(name="find-unadopted", **RETRY)
def find_unadopted(path: str, run: str, pattern: str = "checkpoint-*", quiet_s: float = 60.0) -> list[str]:
    """``path`` itself when it is a checkpoint directory, else its finished sub-directories matching
    ``pattern`` that the catalog does not hold yet, oldest step first."""
    root = Path(path).expanduser()
    if root.is_dir() and not any(p.is_dir() for p in root.iterdir()):
        return [str(root)]  # one directory, named by hand: `adopt` says what is wrong with it, if anything
    return [str(p) for p in pending(catalog(), root, run=run, pattern=pattern, quiet_s=quiet_s)]


@task(name="adopt-checkpoint", **RETRY)
def adopt_checkpoint(path: str, run: str, step: int | None = None, fmt: str | None = None) -> dict[str, Any]:
    """Adopt one directory; running it again on the same directory changes nothing."""
    got = adopt(catalog(), Path(path), run=run, step=step, fmt=fmt)
    result = asdict(got)
    if got.action == "adopted":
        event = run_event(
            "rewind.checkpoint.adopted", run, result, step=got.step, checkpoint_id=got.checkpoint_id
        )
        notifier().event(event)
    return result
