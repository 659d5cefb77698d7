"""The on-disk commit protocol for one checkpoint directory.

Order (restic and DCP both teach it): write every file into
``step-<N>.tmp-<pid>-<id>/`` while hashing it, fsync each file and the
directory, write and fsync the manifest, rename the directory to ``step-<N>/``,
fsync the parent. A crash at any point leaves either a ``.tmp-`` directory
(swept on the next start) or a complete, self-describing checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

from infra.checkpoint import manifest as mf
from infra.checkpoint.verify import Finding, Problem
from infra.digest import HashingWriter
from infra.errors import CorruptCheckpoint
from infra.faults import fault_point

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^step-\d+\.tmp-(\d+)-[0-9a-f]+$")

FileWriter = Callable[[BinaryIO], None]


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step}"


def committed_steps(run_dir: Path) -> list[int]:
    """Steps with a final directory (not necessarily valid), newest first."""
    if not run_dir.is_dir():
        return []
    steps = [int(m.group(1)) for p in run_dir.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(steps, reverse=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, fill: FileWriter) -> mf.FileEntry:
    """Create ``path`` (never overwrite), stream ``fill`` into it through the hasher, fsync it."""
    with open(path, "xb") as raw:
        out = HashingWriter(raw)
        fill(out)  # type: ignore[arg-type]
        raw.flush()
        os.fsync(raw.fileno())
    d = out.hasher.result()
    return mf.FileEntry(path=path.name, size=d.size, xxh3=d.xxh3, crc32c=d.crc32c)


def temp_dir(run_dir: Path, step: int) -> Path:
    """A fresh ``step-<N>.tmp-<pid>-<id>/`` for a save in flight."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"step-{step}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, manifest: mf.Manifest) -> Path:
    """Write the manifest into ``tmp``, fsync, rename to ``step-<N>/``, fsync the parent."""
    run_dir = tmp.parent
    final = step_dir(run_dir, manifest.step)
    fault_point("save.before_manifest", manifest.step)
    with open(tmp / mf.MANIFEST_NAME, "xb") as f:
        f.write(manifest.to_bytes())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    fault_point("save.before_rename", manifest.step)
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    os.rename(tmp, final)
    fsync_dir(run_dir)
    return final


def write_checkpoint(
    run_dir: Path,
    manifest: mf.Manifest,
    files: Iterable[tuple[str, FileWriter]],
    *,
    expect: tuple[mf.FileEntry, ...] | None = None,
) -> tuple[Path, mf.Manifest]:
    """Write ``files`` and then the manifest; return the final directory and manifest.

    ``manifest`` supplies everything but the file list. With ``expect`` (a copy
    of another checkpoint), the bytes written must hash to exactly those entries
    before any manifest is written. Raises ``FileExistsError`` if ``step-<N>/``
    already exists: the caller decides what happens to it.
    """
    tmp = temp_dir(run_dir, manifest.step)
    try:
        entries = []
        for name, fill in files:
            entries.append(write_file(tmp / mf.safe_relative(name), fill))
            fault_point("save.file_written", manifest.step)
        fsync_dir(tmp)
        if expect is not None and tuple(entries) != expect:
            bad = [
                Finding(Problem.DIGEST, e.path, "copy differs from its source")
                for e in entries
                if e not in expect
            ]
            raise CorruptCheckpoint(
                str(tmp), bad or [Finding(Problem.MISSING, "*", "file list differs from its source")]
            )
        manifest = replace(manifest, files=tuple(entries))
        final = commit(tmp, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, manifest


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_temp(run_dir: Path) -> list[Path]:
    """Remove ``.tmp-`` directories left by a killed save; return what was removed."""
    removed = []
    if not run_dir.is_dir():
        return removed
    for p in run_dir.iterdir():
        m = _TMP_DIR.match(p.name)
        if m and (int(m.group(1)) == os.getpid() or not pid_alive(int(m.group(1)))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def quarantine(path: Path, reason: str) -> Path:
    """Move a damaged or superseded checkpoint aside, keeping its bytes for inspection."""
    target_dir = path.parent / ".quarantine"
    target_dir.mkdir(exist_ok=True)
    target = target_dir / f"{path.name}-{reason}-{uuid.uuid4().hex[:8]}"
    os.rename(path, target)
    with contextlib.suppress(OSError):
        fsync_dir(path.parent)
    return target
