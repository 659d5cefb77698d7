"""A checkpoint directory another library just wrote, taken over into Rewind's local tier.

The library's files are moved (renamed on the same filesystem, copied then removed across
filesystems), each fsynced, then the directory is renamed to its step's name and its parent fsynced:
after ``take_over`` returns, the directory is durable where Rewind keeps its checkpoints, and nothing of
it is left where the library wrote it. It is then adopted (hashed, manifest written last, registered).
A take-over killed half-way leaves a ``step-<N>.tmp-<pid>-<id>/`` (swept, as a killed save's, by
``store.sweep_temp``) or a ``step-<N>/`` with no manifest (removed by the next take-over of that step).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

from rewind.infra.errors import ConfigError
from rewind.infra.format import local_tier, store
from rewind.infra.format import manifest as mf


def take_over(source: Path, run_dir: Path, step: int) -> Path:
    """Move ``source`` to ``run_dir/step-<step>`` (or ``step-<step>.<id>`` when that name holds an older
    timeline's checkpoint), durable; returns where it now lies."""
    if not source.is_dir():
        raise ConfigError(f"{source} is not a directory: nothing to take over")
    local_tier.ensure(run_dir.parent)  # the disk's mark: its copies are told apart from other disks'
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"step-{step}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        source.rename(tmp)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.copytree(source, tmp, symlinks=True)
        shutil.rmtree(source)
    _fsync_tree(tmp)
    final = store.step_dir(run_dir, step)
    if final.exists() and not (final / mf.MANIFEST_NAME).exists():
        shutil.rmtree(final)  # a take-over killed before its adoption: never a checkpoint, nothing to keep
    if final.exists():  # rolled back past this step earlier: that directory is the old timeline's
        final = run_dir / f"step-{step}.{uuid.uuid4().hex[:16]}"
    tmp.rename(final)
    store.fsync_dir(run_dir)
    return final


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):  # files before the directories holding them
        if path.is_symlink():
            continue
        if path.is_dir():
            store.fsync_dir(path)
        else:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    store.fsync_dir(root)
