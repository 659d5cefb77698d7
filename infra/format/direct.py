"""A new file written past the page cache (``O_DIRECT``), so that a save takes as few of the job's CPU
cycles as it can: the kernel neither copies the bytes into its cache nor writes them back later, and the
job's own memory is not reclaimed to make room for them.

Bytes go through a page-aligned buffer (``BLOCK``) and out in whole blocks, or, for a large source that
lies at the address its bytes take in the file (staged tensors), straight from where it lies. Buffers are
kept for the next file (at most ``KEEP``: a save's next file does not fault fresh pages in); a forked child
never shares their pages (it gets zeros there, or on an older kernel nothing). The last part that is not a
whole number of ``ALIGN`` blocks goes through the page cache, so the file is never longer than its bytes
and a small file is never written directly.
Where the filesystem refuses direct writes (tmpfs before Linux 6.6, ramfs, some network or FUSE
filesystems: when asked, or at a write), the rest of the file goes through the page cache.
``REWIND_DIRECT_WRITES=off`` writes every file through the page cache (through the same buffer).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import sys
import threading
from pathlib import Path
from types import TracebackType

from rewind.infra.errors import ConfigError

ALIGN = 4096  # a multiple of every logical block size in use (512, 4096)
BLOCK = 4 << 20  # as fast as 16 MiB here (dd oflag=direct: 1.7 GB/s each); a quarter of the memory
ENV = "REWIND_DIRECT_WRITES"
REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}  # the filesystem takes no direct writes
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every file goes through the page cache
STRAIGHT_FROM = 1 << 20  # a write this large goes to the disk from where it lies, when it can
KEEP = 4  # buffers kept for the next files (``store.WRITE_STREAMS`` written at once); any more are unmapped

_LINUX = sys.platform.startswith("linux")
_MADV_WIPEONFORK = 18  # Linux 4.14+ (Python 3.11's mmap does not name it): a forked child gets zeros there

_lock = threading.Lock()
_free: list[mmap.mmap] = []
_not_inherited = False  # buffers made MADV_DONTFORK (a kernel without WIPEONFORK): absent in a forked child


def wanted() -> bool:
    """``REWIND_DIRECT_WRITES``: ``auto`` (the default: direct where the filesystem takes it) or ``off``;
    anything else a one-line ``ConfigError``."""
    raw = os.environ.get(ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "off"):
        raise ConfigError(f"{ENV}: {raw!r} is not auto or off")
    return raw == "auto" and bool(_O_DIRECT)


def _address(view: memoryview) -> int | None:
    """Where ``view``'s bytes lie (None for a read-only buffer: ctypes will not say)."""
    if view.readonly:
        return None
    try:
        probe = ctypes.c_char.from_buffer(view)
    except (TypeError, ValueError):
        return None
    addr = ctypes.addressof(probe)
    del probe  # lets the view go: it is released when the write ends
    return addr


def _take() -> mmap.mmap:
    """A page-aligned buffer of ``BLOCK`` bytes: a kept one, or a new private one whose pages a forked child
    does not share (an ``O_DIRECT`` write in flight at a fork must not meet a copy-on-write page)."""
    global _not_inherited
    with _lock:
        if _free:
            return _free.pop()
    buf = mmap.mmap(-1, BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _LINUX:
        try:
            buf.madvise(_MADV_WIPEONFORK)  # the child's is zeros at the same address: a buffer of its own
        except OSError:
            buf.madvise(mmap.MADV_DONTFORK)
            _not_inherited = True
    return buf


def _give(buf: mmap.mmap) -> None:
    with _lock:
        if len(_free) < KEEP:
            _free.append(buf)
            return
    buf.close()


def _forget(buf: mmap.mmap) -> None:
    """A parent's buffer in a forked child. Wiped on fork, it is the child's own, closed as any other; not
    mapped at all (``MADV_DONTFORK``), it must never be used nor closed (closing would unmap whatever the
    child maps there later, even at the interpreter's exit): its object is kept for the process's life."""
    if _not_inherited:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(buf))
    else:
        buf.close()


def _in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    for buf in _free:
        _forget(buf)
    _free.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)


class NewFile:
    """A file created at ``path`` (never one that exists), written with ``write``, synced by ``close``."""

    def __init__(self, path: Path, *, length: int = 0) -> None:
        """``length``: the bytes the file will hold, where known, given to it before any (a tmpfs mounted
        ``huge=within_size`` holds a file in huge pages only within its length, on kernels that do not count
        a write's own end); ``close`` leaves it exactly as long as what was written."""
        direct = wanted()
        self._pid = os.getpid()
        self._buf: mmap.mmap | None = _take()
        self._view = memoryview(self._buf)
        self._fd = -1
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except BaseException:
            self._release()
            raise
        self._pos = 0
        self.size = 0
        self._length = length
        try:
            if length:
                os.ftruncate(self._fd, length)
            self.direct = direct and self._set_direct()
        except BaseException:
            self._release()
            raise

    def _set_direct(self) -> bool:
        """Direct writes asked for on the open file (asking at the open would leave a file behind when
        the filesystem refuses them)."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) | _O_DIRECT)
        except OSError as exc:
            if exc.errno not in REFUSED:
                raise
            return False
        return True

    def _ours(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                "a file opened before a fork is written and closed only by the process that opened it"
            )

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._ours()
        with memoryview(data) as whole, whole.cast("B") as src:
            n = len(src)
            at = self._straight(src) if self.direct and n >= STRAIGHT_FROM else 0
            while at < n:
                take = min(n - at, BLOCK - self._pos)
                self._view[self._pos : self._pos + take] = src[at : at + take]
                self._pos += take
                at += take
                if self._pos == BLOCK:
                    self._drain(0, BLOCK)
        self.size += n
        return n

    def _straight(self, src: memoryview) -> int:
        """When ``src`` lies at an address its bytes take in the file (modulo ``ALIGN``), its whole blocks
        go to the disk from where they are, not through the buffer (the bytes before the first boundary
        do, after what the buffer held). How many bytes of ``src`` are written or buffered."""
        addr = _address(src)
        if addr is None or (addr - self._pos) % ALIGN:
            return 0
        head = -self._pos % ALIGN  # the buffer starts on a boundary: this many bytes bring it to the next
        self._view[self._pos : self._pos + head] = src[:head]
        self._pos += head
        self._drain(0, self._pos)
        end = head + (len(src) - head) // ALIGN * ALIGN
        if not self.direct:  # refused while the buffer went out: the rest through the buffer
            return head
        with src[head:end] as blocks:
            self._write_all(blocks)
        return end

    def _drain(self, start: int, end: int) -> None:
        """The buffer's bytes ``start:end`` out, and the buffer empty."""
        with self._view[start:end] as part:
            self._write_all(part)
        self._pos = 0

    def _buffered(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct = False

    def _write_all(self, data: memoryview) -> None:
        """``data`` out: directly (whole blocks from a page-aligned address), or through the page cache once
        the filesystem refused a direct write (a refused write writes nothing and leaves the offset: the
        rest goes on from there)."""
        done = 0
        while done < len(data):
            try:
                with data[done:] as part:
                    n = os.write(self._fd, part)
            except OSError as exc:
                if exc.errno not in REFUSED or not self.direct:
                    raise
                self._buffered()
                continue
            if n <= 0:
                raise OSError(errno.EIO, "the filesystem took no bytes")
            done += n
            if done < len(data) and self.direct and n % ALIGN:
                self._buffered()  # a short direct write left an unaligned rest: finish through the cache

    def close(self) -> None:
        """The rest out (its whole blocks directly, the last piece through the page cache), synced, closed."""
        self._ours()
        try:
            pos = self._pos
            whole = pos // ALIGN * ALIGN if self.direct else pos
            if whole:
                with self._view[0:whole] as part:
                    self._write_all(part)
            if pos > whole:  # the last piece, not a whole block: through the page cache
                self._buffered()
                with self._view[whole:pos] as part:
                    self._write_all(part)
            self._pos = 0
            if self._length and self._length != self.size:
                os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
        finally:
            self._release()

    def _release(self) -> None:
        fd, self._fd = self._fd, -1
        try:
            if fd >= 0:
                os.close(fd)
        finally:
            buf, self._buf = self._buf, None
            if buf is not None:
                self._view.release()
                if os.getpid() == self._pid:
                    _give(buf)
                else:  # a parent's file in a forked child (its __exit__)
                    _forget(buf)

    def __enter__(self) -> NewFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self._release()
