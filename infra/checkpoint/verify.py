"""Checking a checkpoint directory against its manifest.

Like restic's checker it keeps going and returns every finding instead of
stopping at the first, so a user sees all that is wrong at once. ``deep``
re-reads and re-hashes every byte; quick only checks presence and sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from infra.checkpoint import manifest as mf
from infra.digest import CHUNK, Hasher, hash_file
from infra.errors import CorruptCheckpoint
from infra.faults import fault_point


class Problem(StrEnum):
    MANIFEST = "manifest"  # missing, malformed, escaping path, bad HMAC
    MISSING = "missing"
    SIZE = "size_mismatch"
    DIGEST = "digest_mismatch"
    UNREADABLE = "unreadable"
    UNLISTED = "unlisted"  # a file the manifest does not name; reported, not fatal


@dataclass(frozen=True, slots=True)
class Finding:
    problem: Problem
    path: str
    detail: str

    @property
    def fatal(self) -> bool:
        return self.problem is not Problem.UNLISTED

    def __str__(self) -> str:
        return f"{self.path}: {self.problem.value} ({self.detail})"

    def as_dict(self) -> dict[str, str]:
        return {"problem": self.problem.value, "path": self.path, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class Report:
    directory: Path
    manifest: mf.Manifest | None
    findings: tuple[Finding, ...]
    deep: bool

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not any(f.fatal for f in self.findings)


def check_entry(directory: Path, entry: mf.FileEntry, deep: bool) -> Finding | None:
    path = directory / entry.path
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return Finding(Problem.MISSING, entry.path, "listed in the manifest but not on disk")
    except OSError as exc:
        return Finding(Problem.UNREADABLE, entry.path, str(exc))
    if size != entry.size:
        return Finding(Problem.SIZE, entry.path, f"manifest says {entry.size} bytes, file has {size}")
    if deep:
        fault_point("verify.read")  # outside the try: an injected fault is an error, not a finding
        try:
            got = hash_file(path, with_crc=False)
        except OSError as exc:
            return Finding(Problem.UNREADABLE, entry.path, str(exc))
        if got.xxh3 != entry.xxh3:
            return Finding(Problem.DIGEST, entry.path, f"xxh3 {got.xxh3} != manifest {entry.xxh3}")
    return None


def verify_directory(directory: Path, deep: bool = False) -> Report:
    try:
        manifest = mf.read(directory)
    except mf.ManifestError as exc:
        return Report(directory, None, (Finding(Problem.MANIFEST, mf.MANIFEST_NAME, str(exc)),), deep)
    findings = [f for e in manifest.files if (f := check_entry(directory, e, deep)) is not None]
    listed = {e.path for e in manifest.files} | {mf.MANIFEST_NAME}
    for root, _dirs, names in os.walk(directory):
        for name in names:
            rel = Path(root, name).relative_to(directory).as_posix()
            if rel not in listed:
                findings.append(Finding(Problem.UNLISTED, rel, "present on disk, not in the manifest"))
    return Report(directory, manifest, tuple(findings), deep)


def read_verified(directory: Path, entry: mf.FileEntry) -> torch.Tensor:
    """Read a whole file into a fresh buffer and prove it matches ``entry`` before returning it.

    The bytes that are hashed are the bytes that get loaded, so a file changed
    between a check and a load cannot slip through.
    """
    location = str(directory)
    finding = check_entry(directory, entry, deep=False)
    if finding is not None:
        raise CorruptCheckpoint(location, [finding])
    buf = torch.empty(entry.size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    h = Hasher(with_crc=False)
    with open(directory / entry.path, "rb", buffering=0) as f:
        pos = 0
        while pos < entry.size:
            n = f.readinto(view[pos : pos + CHUNK])
            if not n:
                break
            h.update(view[pos : pos + n])
            pos += n
        extra = f.read(1)
    got = h.result()
    if pos != entry.size or extra:
        raise CorruptCheckpoint(
            location, [Finding(Problem.SIZE, entry.path, "file changed size while being read")]
        )
    if got.xxh3 != entry.xxh3:
        raise CorruptCheckpoint(
            location, [Finding(Problem.DIGEST, entry.path, f"xxh3 {got.xxh3} != manifest {entry.xxh3}")]
        )
    return buf
