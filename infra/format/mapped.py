"""A checkpoint file on a memory filesystem read by mapping it copy-on-write, not by copying it.

A file in the memory tier (tmpfs) is memory already: reading it into new tensors would fault in as many
fresh pages and copy every byte. Instead the file is mapped private (``MAP_PRIVATE``: a page the job
writes becomes the job's own copy; the tier's copy never changes), every byte of the mapping is hashed
against the file's entry, and only then are tensors made over the mapping's pages. Only for tensors the
caller copies into its own and lets go (a module's parameters and buffers): a first write to a mapped page
costs more than the copy saved.

This holds because a checkpoint's file must never be written in place once written (design.md §4.1):
copies are made under new names (exclusive create, temporary files renamed) and are only ever unlinked,
so the bytes under a proven mapping cannot change (an unlinked file's pages live on while mapped). Any
memory filesystem qualifies, the memory tier's and a local tier's on tmpfs alike.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rewind.infra import cpus, progress
from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import dropping, in_place, pages, segments, tensorfile
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import CHUNK, Hasher
from rewind.infra.format.verify import Finding, Problem, entry_mismatch, open_entry

log = logging.getLogger(__name__)

TMPFS_MAGIC, RAMFS_MAGIC = 0x01021994, 0x858458F6
MIN_BYTES = 1 << 20  # a smaller file is read: mapping it saves nothing worth its page-table cost
MADV_POPULATE_READ = 22  # Linux 5.14: fault the pages in, an I/O error reported as an errno, not a SIGBUS
SPAN = 32 << 20  # faulted in by one helper at a time, ahead of the hash; a worker's segments at a time
HELPERS = 2  # a helper faults pages in at about half the rate one thread hashes them
MAX_WORKERS = 16  # segments hashed at once, at most (each a core's worth of memory bandwidth)
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux


def _libc() -> Any:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        libc.statfs.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def in_memory(directory: Path) -> bool:
    """Whether ``directory`` lies on a memory filesystem (tmpfs, ramfs); False where that cannot be told.
    ``f_type`` is struct statfs's first word on x86-64 and aarch64 (elsewhere this reads another field
    and says False: files are then read, as without mapping)."""
    if _LIBC is None:
        return False
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _LIBC.statfs(os.fsencode(directory), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF in (TMPFS_MAGIC, RAMFS_MAGIC)


def verified_mapping(directory: Path, entry: mf.FileEntry) -> memoryview | None:
    """``entry``'s file mapped copy-on-write, every byte proven against ``entry``; None when the file is not
    on a memory filesystem, is small, or cannot be mapped (read it the usual way). ``CorruptCheckpoint``
    for a missing or different file, ``OSError`` for an I/O error, as ``verify.verified_read``.

    The view returned is what keeps the mapping: it must never be released while a tensor made over it
    lives (``torch.frombuffer`` holds the view, not the mapping)."""
    whole = _opened(directory, entry)
    if whole is None:
        return None
    view = memoryview(whole)
    try:
        if entry.segments and len(entry.segments) == segments.count(len(whole)):
            wrong = _segment_mismatch(whole, view, directory, entry)
        else:
            wrong = entry_mismatch(entry, len(whole), _populated_hash(whole, view, directory, entry))
    except BaseException:
        _close(whole, view)
        raise
    if wrong is not None:
        _close(whole, view)
        raise CorruptCheckpoint(str(directory), [wrong])
    return view


def verified_into(directory: Path, entry: mf.FileEntry, into: Mapping[str, torch.Tensor]) -> bool:
    """``entry``'s file loaded straight into ``into`` (tensors by name that take every tensor of the file,
    ``in_place``), each segment proven against the catalog's record before its bytes are copied; False,
    nothing written, where it cannot be (not on a memory filesystem, small, no fitting segment record, the
    tensors do not fit: read it the usual way). ``CorruptCheckpoint`` for a missing or different file and
    ``OSError`` for an I/O error, as ``verified_mapping``: ``into`` may hold proven bytes of it by then
    (their version counters are bumped once the header is proven and they are to be copied into, before
    the first byte is, as ``copy_`` would bump them)."""
    fits = entry.segments and len(entry.segments) == segments.count(entry.size)
    whole = _opened(directory, entry) if into and fits else None
    if whole is None:
        return False
    view = memoryview(whole)
    try:
        placements = _planned(view, _address(whole), directory, entry, into)
        if placements:  # from here the tensors may be written: marked so, as a copy_ into them would be
            torch.autograd.graph.increment_version(list(into.values()))
        wrong = _segment_mismatch(whole, view, directory, entry, placements) if placements else None
    finally:
        dropping.later(lambda: _close(whole, view))  # the page-table teardown off the restore's path
    if wrong is not None:
        raise CorruptCheckpoint(str(directory), [wrong])
    return bool(placements)


def _close(whole: mmap.mmap, view: memoryview) -> None:
    """The view let go, then the mapping closed; where a worker still holds a piece of it (an interrupted
    restore's, which the interrupt did not wait for), the mapping goes when the last piece does."""
    view.release()
    try:
        whole.close()
    except BufferError:
        log.warning("a mapping of a memory copy is still in use: unmapped when its last user lets it go")


def _planned(
    view: memoryview, base: int, directory: Path, entry: mf.FileEntry, into: Mapping[str, torch.Tensor]
) -> tuple[in_place.Placement, ...]:
    """Where the file's tensors go in ``into``, its header read only once the segments it lies in are
    proven; none for a header that does not parse (the usual read names it)."""
    proven = _proven(view, base, 0, directory, entry)
    try:
        end = tensorfile.header_end(view)
        while proven < end:
            proven = _proven(view, base, proven, directory, entry)
        data, spans, _ = tensorfile.laid_out(view)
    except (ValueError, EOFError):
        return ()
    return in_place.plan(data, spans, into)


def _proven(view: memoryview, base: int, at: int, directory: Path, entry: mf.FileEntry) -> int:
    """The segment at ``at`` proven against the catalog's record (``CorruptCheckpoint`` if it differs); where
    it ends."""
    end = min(at + segments.SEGMENT, len(view))
    with view[at:end] as piece:
        err, got = _segment_digest(piece, base + at)
    _check(err, directory, entry)
    if got != entry.segments[at // segments.SEGMENT]:
        raise CorruptCheckpoint(
            str(directory), [_segment_finding(entry, at // segments.SEGMENT, at, len(view), got)]
        )
    return end


def _opened(directory: Path, entry: mf.FileEntry) -> mmap.mmap | None:
    """``entry``'s file mapped private; None when it is small, not on a memory filesystem, or cannot be
    mapped. ``CorruptCheckpoint`` for a missing file or one of another size."""
    if entry.size < MIN_BYTES or not in_memory(directory):
        return None
    with open_entry(directory, entry) as f:
        return _map(f.fileno(), directory, entry)


def _map(fd: int, directory: Path, entry: mf.FileEntry) -> mmap.mmap | None:
    """The open file mapped private; None when it cannot be (read it instead)."""
    size = os.fstat(fd).st_size
    if size != entry.size:
        raise CorruptCheckpoint(str(directory), [_size(entry, size)])
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except ValueError:  # shorter than it was a moment ago
        raise CorruptCheckpoint(str(directory), [_size(entry, os.fstat(fd).st_size)]) from None
    except OSError:  # no address space or commit charge for it
        return None


def _size(entry: mf.FileEntry, size: int) -> Finding:
    return Finding(Problem.SIZE, entry.path, f"manifest says {entry.size} bytes, the file holds {size}")


def _populated_hash(whole: mmap.mmap, view: memoryview, directory: Path, entry: mf.FileEntry) -> str:
    """The xxh3 of the mapping, its pages faulted in ahead of the hash a span at a time by helper threads
    (``MADV_POPULATE_READ``: the kernel's page-table work, most of a mapped read's cost, runs on other
    cores while this thread hashes the spans already in)."""
    base = _address(whole)
    spans = [(at, min(SPAN, len(whole) - at)) for at in range(0, len(whole), SPAN)]
    hasher = Hasher(with_crc=False)
    with ThreadPoolExecutor(max_workers=_helpers(len(spans)), thread_name_prefix="rewind-populate") as pool:
        faulted = [_submitted(pool, base + at, size) for at, size in spans]
        try:
            for (at, size), done in zip(spans, faulted, strict=True):
                _check(done.result() if done else _populate(base + at, size), directory, entry)
                for pos in range(at, at + size, CHUNK):
                    with view[pos : min(pos + CHUNK, at + size)] as piece:
                        hasher.update(piece)
                    progress.advance(min(CHUNK, at + size - pos))
        except BaseException:
            for f in faulted:
                if f:
                    f.cancel()
            raise
    return hasher.result().xxh3


def _segment_mismatch(
    whole: mmap.mmap,
    view: memoryview,
    directory: Path,
    entry: mf.FileEntry,
    placements: Sequence[in_place.Placement] = (),
) -> Finding | None:
    """The first segment of the mapping whose xxh3 is not the one the catalog recorded (``entry.segments``),
    None when every one is; a ``SPAN`` of segments at a time faulted in and hashed by a worker, on every
    core at once, each segment copied where ``placements`` put its bytes once it matched."""
    base, size, seg = _address(whole), len(whole), segments.SEGMENT
    per = max(1, SPAN // seg)  # segments a worker takes at a time
    firsts = range(0, segments.count(size), per)

    def hashed(first: int) -> list[tuple[int, str]]:  # each segment's (errno faulting it in, digest)
        out = []
        for i in range(first, min(first + per, len(entry.segments))):
            at, end = i * seg, min(i * seg + seg, size)
            with view[at:end] as piece:  # an export: the mapping cannot be closed under the hash or the copy
                out.append(_segment_digest(piece, base + at))
                if out[-1][1] != entry.segments[i]:
                    break  # the rest are not looked at
                if placements:
                    in_place.copy_proven(placements, at, end, base)
        return out

    workers = max(1, min(len(firsts), cpus.usable(), MAX_WORKERS))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rewind-segment") as pool:
        done = [_started(pool, hashed, first) for first in firsts]
        try:
            for first, job in zip(firsts, done, strict=True):
                for i, (err, got) in enumerate(job.result() if job else hashed(first), start=first):
                    _check(err, directory, entry)
                    if got != entry.segments[i]:
                        return _segment_finding(entry, i, i * seg, size, got)
                    progress.advance(min(seg, size - i * seg))
        finally:
            for job in done:
                if job:
                    job.cancel()
    return None


def _segment_digest(piece: memoryview, address: int) -> tuple[int, str]:
    """A piece of the mapping (at ``address``) faulted in and hashed: (errno faulting it in, its xxh3;
    empty after an error)."""
    err = _populate(address, len(piece))
    if err not in (0, errno.EINVAL, errno.ENOSYS):
        return err, ""
    hasher = Hasher(with_crc=False)
    hasher.update(piece)
    return 0, hasher.result().xxh3


def _segment_finding(entry: mf.FileEntry, i: int, at: int, size: int, got: str) -> Finding:
    end = min(at + segments.SEGMENT, size)
    detail = f"segment {i} (bytes {at}..{end}) xxh3 {got} != the catalog's {entry.segments[i]}"
    return Finding(Problem.DIGEST, entry.path, detail)


def _started(
    pool: ThreadPoolExecutor, hashed: Callable[[int], list[tuple[int, str]]], first: int
) -> Future[list[tuple[int, str]]] | None:
    """The segments from ``first`` hashed by a worker; None where no thread can be started (this thread
    hashes them)."""
    try:
        return pool.submit(hashed, first)
    except RuntimeError:
        return None


def _address(whole: mmap.mmap) -> int:
    """The mapping's address (through an export of it, let go at once)."""
    anchor = ctypes.c_char.from_buffer(whole)
    base = ctypes.addressof(anchor)
    del anchor
    return base


def _submitted(pool: ThreadPoolExecutor, first: int, nbytes: int) -> Future[int] | None:
    """The span faulted in by a helper; None where no helper thread can be started (a process limit on
    threads, the interpreter shutting down): this thread faults it in as it hashes it."""
    try:
        return pool.submit(_populate, first, nbytes)
    except RuntimeError:
        return None


def _helpers(spans: int) -> int:
    return max(1, min(HELPERS, spans, cpus.usable()))


def _populate(first: int, nbytes: int) -> int:
    """The pages of ``first`` .. ``first + nbytes`` faulted in; the errno, 0 when they are in."""
    return 0 if pages.madvise(first, nbytes, MADV_POPULATE_READ) else ctypes.get_errno()


def _check(err: int, directory: Path, entry: mf.FileEntry) -> None:
    """An error faulting pages in is an error here (a file cut short since it was mapped a SIZE finding, an
    I/O error an ``OSError``), where touching them while hashing would kill the process (SIGBUS). A kernel
    without it (before 5.14) is let be: the hash faults them in. A file cut short after this still faults
    while hashed or used: no checkpoint file is ever cut short (design.md §4.1)."""
    if err in (0, errno.EINVAL, errno.ENOSYS):
        return
    if err == errno.EFAULT:  # past the end of the file: it was cut short
        size = os.stat(directory / mf.safe_relative(entry.path)).st_size
        raise CorruptCheckpoint(str(directory), [_size(entry, size)])
    raise OSError(err, f"reading a mapped file: {os.strerror(err)}")
