"""Reading a copy's files from a nearer copy first (``Nearest``): every byte is proven wherever it is read, a
nearer file that is missing, damaged or not a regular file is read from the copy itself, and the bytes each
place served are counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_bytes
from rewind.infra.format.nearest import Nearest

RAW = b"tensor bytes " * 1000


def _entry(raw: bytes = RAW) -> mf.FileEntry:
    d = hash_bytes(raw)
    return mf.FileEntry(path="__0_0.distcp", size=d.size, xxh3=d.xxh3, crc32c=d.crc32c)


def _dirs(tmp_path: Path, near: bytes | None, here: bytes = RAW) -> tuple[Path, Path]:
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    disk.mkdir()
    memory.mkdir()
    (disk / "__0_0.distcp").write_bytes(here)
    if near is not None:
        (memory / "__0_0.distcp").write_bytes(near)
    return disk, memory


def test_a_file_the_nearer_copy_proves_is_read_there(tmp_path: Path) -> None:
    disk, memory = _dirs(tmp_path, RAW, here=b"x" * len(RAW))  # the disk's bytes would not prove
    reads = Nearest(disk, {"__0_0.distcp": memory})
    assert reads.read(_entry()) == RAW
    assert (reads.near_bytes, reads.here_bytes) == (len(RAW), 0)


@pytest.mark.parametrize("nearer", ["damaged", "missing", "link"])
def test_a_nearer_file_that_does_not_prove_is_read_from_the_copy(tmp_path: Path, nearer: str) -> None:
    damaged = bytearray(RAW)
    damaged[7] ^= 1
    disk, memory = _dirs(tmp_path, bytes(damaged) if nearer == "damaged" else None)
    if nearer == "link":  # a link to the very bytes: still never read through
        (memory / "__0_0.distcp").symlink_to(disk / "__0_0.distcp")
    reads = Nearest(disk, {"__0_0.distcp": memory})
    assert reads.read(_entry()) == RAW
    assert (reads.near_bytes, reads.here_bytes) == (0, len(RAW))


def test_when_neither_proves_the_copy_is_corrupt(tmp_path: Path) -> None:
    disk, memory = _dirs(tmp_path, b"y" * len(RAW), here=b"x" * len(RAW))
    with pytest.raises(CorruptCheckpoint):
        Nearest(disk, {"__0_0.distcp": memory}).read(_entry())
