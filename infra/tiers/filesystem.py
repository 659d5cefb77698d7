"""Copy a committed checkpoint to another filesystem (a shared path), with the same commit protocol.

The copy is hashed as it is written and compared with the source manifest before
its own manifest is written; a copy that differs is discarded, never registered.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from infra.checkpoint import manifest as mf
from infra.checkpoint import store
from infra.checkpoint.verify import verify_directory
from infra.digest import CHUNK
from infra.errors import ConfigError


def target_root(uri: str) -> Path:
    """``file:///shared/ckpt`` or a plain absolute path."""
    path = uri.removeprefix("file://")
    if "://" in path or not path.startswith("/"):
        raise ConfigError(f"shared tier target must be an absolute path or file:// URL, got {uri!r}")
    return Path(path)


def _copier(src: Path) -> Callable[[BinaryIO], None]:
    def fill(out: BinaryIO) -> None:
        with open(src, "rb") as f:
            shutil.copyfileobj(f, out, CHUNK)

    return fill


def replicate(source: Path, root: Path, run: str) -> tuple[Path, int]:
    """Copy ``source`` (a verified checkpoint directory) to ``root/run/step-N``; returns (path, bytes copied).

    Idempotent: a complete, verifying copy already there is kept and 0 bytes are copied.
    """
    src_manifest = mf.read(source)
    dest = store.step_dir(root / run, src_manifest.step)
    if dest.exists():
        if verify_directory(dest, deep=True).ok and mf.read(dest).files == src_manifest.files:
            return dest, 0
        store.quarantine(dest, "stale-replica")
    store.sweep_temp(root / run)
    files = [(e.path, _copier(source / e.path)) for e in src_manifest.files]
    final, written = store.write_checkpoint(root / run, src_manifest, files, expect=src_manifest.files)
    return final, written.total_bytes
