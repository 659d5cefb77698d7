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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from infra.errors import CorruptCheckpoint
from infra.faults import fault_point
from infra.format import manifest as mf
from infra.format.digest import HashingWriter, manifest_digest
from infra.format.verify import Finding, Problem

_TMP_DIR = re.compile(r"^step-\d+\.tmp-(\d+)-[0-9a-f]+$")

FileWriter = Callable[[BinaryIO], None]


@dataclass(frozen=True, slots=True)
class Committed:
    """A checkpoint directory as committed, and the digest of its manifest's bytes (the catalog's record)."""

    path: Path
    manifest: mf.Manifest
    digest: str


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step}"


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


Displace = Callable[[Path], None]


def commit(
    tmp: Path, manifest: mf.Manifest, raw: bytes | None = None, *, displace: Displace | None = None
) -> Committed:
    """Write the manifest (``raw``, or ``manifest`` signed now) into ``tmp``, fsync, rename, fsync the parent.

    ``displace`` moves an existing ``step-<N>/`` out of the way just before the rename
    (a copy replacing one that did not prove itself); without it, one is an error.
    """
    run_dir = tmp.parent
    final = step_dir(run_dir, manifest.step)
    raw = manifest.to_bytes() if raw is None else raw
    fault_point("save.before_manifest", manifest.step)
    with open(tmp / mf.MANIFEST_NAME, "xb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    fault_point("save.before_rename", manifest.step)
    if final.exists() and displace is not None:
        displace(final)
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    os.rename(tmp, final)
    fsync_dir(run_dir)
    return Committed(final, manifest, manifest_digest(raw))


def write_checkpoint(
    run_dir: Path,
    manifest: mf.Manifest,
    files: Iterable[tuple[str, FileWriter]],
    *,
    copy_of: bytes | None = None,
    displace: Displace | None = None,
) -> Committed:
    """Write ``files`` and then the manifest.

    ``manifest`` supplies everything but the file list. With ``copy_of`` (the raw
    manifest of the checkpoint being copied, already held to the catalog's digest),
    the bytes written must hash to exactly its entries before that same manifest is
    written, byte for byte. Raises ``FileExistsError`` if ``step-<N>/`` already
    exists, unless ``displace`` moves it aside once everything else has been proven.
    """
    tmp = temp_dir(run_dir, manifest.step)
    try:
        entries = []
        for name, fill in files:
            entries.append(write_file(tmp / mf.safe_relative(name), fill))
            fault_point("save.file_written", manifest.step)
        fsync_dir(tmp)
        if copy_of is not None:
            _same_files(tmp, manifest.files, entries)
            return commit(tmp, manifest, copy_of, displace=displace)
        return commit(tmp, replace(manifest, files=tuple(entries)))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _same_files(tmp: Path, expected: tuple[mf.FileEntry, ...], written: list[mf.FileEntry]) -> None:
    """A copy must hash to exactly the entries of the manifest it copies, before that manifest is written."""
    want = {e.path: e for e in expected}
    bad = [
        Finding(Problem.DIGEST, e.path, "differs from the manifest it copies")
        for e in written
        if want.get(e.path) is None or (want[e.path].size, want[e.path].xxh3) != (e.size, e.xxh3)
    ]
    if len(written) != len(want):
        bad.append(Finding(Problem.MISSING, "*", "the copy's file list differs from the manifest's"))
    if bad:
        raise CorruptCheckpoint(str(tmp), bad)


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
    removed: list[Path] = []
    if not run_dir.is_dir():
        return removed
    for p in run_dir.iterdir():
        m = _TMP_DIR.match(p.name)
        if m and (int(m.group(1)) == os.getpid() or not pid_alive(int(m.group(1)))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


QUARANTINE = ".quarantine"


def owned(path: Path, root: Path) -> bool:
    """Is ``path`` a checkpoint directory Rewind wrote, and so may move or delete?

    Not when its manifest says it was adopted (the user's own directory); otherwise when it
    lies under the local tier's ``root``, or its manifest names a Rewind engine as its writer.
    """
    if not path.is_dir():
        return False
    try:
        engine: str | None = mf.read(path).writer.get("engine", "")
    except (OSError, mf.ManifestError):
        engine = None  # damaged or gone: only where it lies can tell
    if engine is not None and engine.startswith("adopted:"):
        return False
    return path.resolve().is_relative_to(root.resolve()) or (engine or "").startswith("rewind.")


def quarantine(path: Path, reason: str) -> Path:
    """Move a damaged or superseded checkpoint aside, keeping its bytes for inspection."""
    target_dir = path.parent / QUARANTINE
    target_dir.mkdir(exist_ok=True)
    target = target_dir / f"{path.name}-{reason}-{uuid.uuid4().hex[:8]}"
    os.rename(path, target)
    os.utime(target)  # retention counts the grace period from the move
    with contextlib.suppress(OSError):
        fsync_dir(path.parent)
    return target
