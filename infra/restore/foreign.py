"""Restoring checkpoints in formats Rewind did not write (adopted ones), through the same planner and executor.

``load_dcp`` loads a DCP or TorchTitan checkpoint into the caller's state dict,
resharded by DCP to the caller's world: every file's bytes are hashed as DCP reads
them and refused on a mismatch, ``.metadata`` decodes only into DCP's own types.
``verified_directory`` makes a local copy whose every byte matched (fetched from
the nearest tier that has one): what a library that reads its own files (HF
``Trainer(resume_from_checkpoint=...)``) is then given.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rewind.infra import config
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import NoRestorableCheckpoint
from rewind.infra.format import dcp
from rewind.infra.format import manifest as mf
from rewind.infra.format.verify import verify_files
from rewind.infra.restore import execute, plan
from rewind.infra.restore.execute import Restored


def verified_directory(
    cat: Catalog,
    run: str,
    *,
    step: int | None = None,
    root: Path | None = None,
    tiers: Collection[str] | None = None,
) -> Restored[None]:
    """A local copy of the newest (or the chosen) checkpoint that proved itself byte for byte."""
    p = plan.plan(cat, run, root=root or config.checkpoint_root(), step=step, tiers=tiers)
    if not p.candidates:
        where = f" on the {', '.join(tiers)} tier" if tiers else ""
        raise NoRestorableCheckpoint(f"run {run!r} has no restorable checkpoint{where}", ())
    return execute.execute(cat, p, verify_files)


def _load_here(state_dict: dict[str, Any], directory: Path, manifest: mf.Manifest) -> None:
    dcp.load(state_dict, directory, {e.path: e for e in manifest.files})


def load_dcp(
    state_dict: dict[str, Any],
    *,
    run: str,
    step: int | None = None,
    catalog: Catalog | None = None,
    root: Path | None = None,
) -> int:
    """Load the newest DCP checkpoint of ``run`` that proves itself into ``state_dict``; returns its step.

    One process: a refused checkpoint is recorded and an older one tried. Several
    ranks (a process group is up): rank 0 proves a copy byte for byte (recording what
    it finds and falling back like one process), then every rank loads from it, each
    checking the bytes it reads again. The directory must be readable by every rank:
    on several nodes, a shared filesystem.
    """
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not multi:
        cat = catalog or Catalog()
        return execute.execute(
            cat, _plan(cat, run, step, root), lambda d, m: _load_here(state_dict, d, m)
        ).step
    if dist.get_rank() != 0:
        return _follow(state_dict, run)
    return _lead(state_dict, catalog or Catalog(), run, step, root)


def _lead(state_dict: dict[str, Any], cat: Catalog, run: str, step: int | None, root: Path | None) -> int:
    """Rank 0: prove every byte (an older checkpoint tried if need be), tell the others, load, and hold
    the restore lease until every rank has read."""
    told = False
    try:
        with execute.restoring(cat, _plan(cat, run, step, root), verify_files) as done:
            dist.broadcast_object_list([("ok", str(done.directory), done.manifest, done.step)], src=0)
            told = True
            _load_here(state_dict, done.directory, done.manifest)
            dist.barrier()
            return done.step
    except BaseException as exc:
        if not told:  # the others wait for a word: give them this one
            dist.broadcast_object_list([("error", f"{type(exc).__name__}: {exc}", None, None)], src=0)
        raise


def _follow(state_dict: dict[str, Any], run: str) -> int:
    """A rank other than 0: load what rank 0 proved, checking every byte again as DCP reads it."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    kind, directory, manifest, at = box[0]
    if kind == "error":
        raise NoRestorableCheckpoint(f"rank 0 could not restore run {run!r}: {directory}", ())
    _load_here(state_dict, Path(directory), manifest)
    dist.barrier()
    return int(at)


def _plan(cat: Catalog, run: str, step: int | None, root: Path | None) -> plan.RestorePlan:
    p = plan.plan(cat, run, root=root or config.checkpoint_root(), step=step)
    if not p.candidates:
        raise NoRestorableCheckpoint(f"run {run!r} has no restorable checkpoint", ())
    return p
