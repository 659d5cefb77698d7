"""A checkpoint file on a memory filesystem read by mapping it copy-on-write, not by copying it.

A file in the memory tier (tmpfs) is memory already: reading it into new tensors would fault in as many
fresh pages and copy every byte. Instead the file is mapped private (``MAP_PRIVATE``: a page the job
writes becomes the job's own copy; the tier's copy never changes), every byte of the mapping is hashed
against the file's entry, and only then are tensors made over the mapping's pages.

This holds because a checkpoint file must never be written in place once it has been written: copies are
made under new names (exclusive create, temporary directories renamed) and are only ever unlinked, so
the bytes under a proven mapping cannot change (an unlinked file's pages live on while mapped).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any, BinaryIO

from rewind.infra import progress
from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import files
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import Hasher
from rewind.infra.format.verify import Finding, Problem, entry_mismatch, not_a_file, open_for_read

TMPFS_MAGIC, RAMFS_MAGIC = 0x01021994, 0x858458F6
MIN_BYTES = 1 << 20  # a smaller file is copied: mapping it saves nothing worth its page-table cost
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type is its first word


def _fstatfs() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):  # not Linux, or no C library to ask
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_FSTATFS = _fstatfs()


def in_memory(f: BinaryIO) -> bool:
    """Whether an open file lies on a memory filesystem (tmpfs, ramfs); False where that cannot be told."""
    if _FSTATFS is None:
        return False
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _FSTATFS(f.fileno(), buf) != 0:
        return False
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return f_type in (TMPFS_MAGIC, RAMFS_MAGIC)


def verified_mapping(directory: Path, entry: mf.FileEntry) -> memoryview | None:
    """``entry``'s file mapped copy-on-write, every byte proven against ``entry``; None when the file is not
    on a memory filesystem or is small (read it the usual way). ``CorruptCheckpoint`` for a missing or
    different file, ``OSError`` for an I/O error, as ``verify.verified_read``."""
    if entry.size < MIN_BYTES:
        return None
    try:
        with open_for_read(directory, entry.path) as f:
            if not in_memory(f):
                return None
            size = os.fstat(f.fileno()).st_size
            wrong = entry_mismatch(entry, size, entry.xxh3) if size != entry.size else None
            if wrong is not None:
                raise CorruptCheckpoint(str(directory), [wrong])
            whole = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(
            str(directory), [Finding(Problem.MISSING, entry.path, "listed in the manifest but not on disk")]
        ) from exc
    except files.NotAFile as exc:
        raise CorruptCheckpoint(str(directory), [not_a_file(entry, exc)]) from exc
    view = memoryview(whole)
    hasher = Hasher(with_crc=False)
    hasher.update(view)
    progress.advance(size)
    wrong = entry_mismatch(entry, size, hasher.result().xxh3)
    if wrong is not None:
        view.release()
        whole.close()
        raise CorruptCheckpoint(str(directory), [wrong])
    return view
