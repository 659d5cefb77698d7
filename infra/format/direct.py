"""A new file written past the page cache (``O_DIRECT``), so that a save takes as few of the job's CPU
cycles as it can: the kernel neither copies the bytes into its cache nor writes them back later, and the
job's own memory is not reclaimed to make room for them.

Bytes go through one page-aligned buffer (``BLOCK``) and out in whole blocks; the last block is padded
with zeros and the file cut back to its length before it is synced. Where the filesystem refuses direct
writes (tmpfs, some network or FUSE filesystems: at the open or at the first write), the file is written
through the page cache as before. ``REWIND_DIRECT_WRITES=off`` writes every file through the page cache.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from pathlib import Path
from types import TracebackType

from rewind.infra.errors import ConfigError

ALIGN = 4096  # a multiple of every logical block size in use (512, 4096)
BLOCK = 16 << 20
ENV = "REWIND_DIRECT_WRITES"
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every file goes through the page cache


def wanted() -> bool:
    """``REWIND_DIRECT_WRITES``: ``auto`` (the default: direct where the filesystem takes it) or ``off``."""
    raw = os.environ.get(ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "off"):
        raise ConfigError(f"{ENV}: {raw!r} is not auto or off")
    return raw == "auto" and bool(_O_DIRECT)


class NewFile:
    """A file created at ``path`` (never one that exists), written with ``write``, synced by ``close``."""

    def __init__(self, path: Path) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self._fd = -1
        self.direct = False
        if wanted():
            try:
                self._fd, self.direct = os.open(path, flags | _O_DIRECT, 0o666), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem takes no direct writes
                    raise
        if self._fd < 0:
            self._fd = os.open(path, flags, 0o666)
        self._buf = mmap.mmap(-1, BLOCK) if self.direct else None  # page-aligned
        self._view = memoryview(self._buf) if self._buf is not None else None
        self._pos = 0
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        src = memoryview(data).cast("B")
        n = len(src)
        if self._view is None:
            self._write_all(src)
        while self._view is not None and len(src):
            take = min(len(src), BLOCK - self._pos)
            self._view[self._pos : self._pos + take] = src[:take]
            self._pos += take
            src = src[take:]
            if self._pos == BLOCK:
                self._drain(self._view, BLOCK)
                self._pos = 0
        self.size += n
        return n

    def _drain(self, view: memoryview, length: int) -> None:
        """Whole blocks out directly; the rest through the page cache if the filesystem refuses."""
        try:
            self._write_all(view[:length])
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            self._buffered()  # nothing of this call was written: a refused direct write writes nothing
            self._write_all(view[:length])

    def _buffered(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct = False

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = os.write(self._fd, view[done:])
            if n == len(view) - done or not self.direct:
                done += n
                continue
            self._buffered()  # a short direct write leaves an unaligned rest: finish through the cache
            done += n

    def close(self) -> None:
        """The last block out (padded, then cut back to the file's length), synced, closed."""
        try:
            if self._view is not None and self._pos:
                if self.direct:
                    padded = -(-self._pos // ALIGN) * ALIGN
                    self._view[self._pos : padded] = bytes(padded - self._pos)
                    self._drain(self._view, padded)
                else:
                    self._write_all(self._view[: self._pos])
            self._pos = 0
            if os.fstat(self._fd).st_size != self.size:
                os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
        finally:
            self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        view, buf, self._view, self._buf = self._view, self._buf, None, None
        with contextlib.suppress(BufferError):  # a slice still held (by an error's traceback): freed with it
            if view is not None:
                view.release()
            if buf is not None:
                buf.close()

    def __enter__(self) -> NewFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close()
        else:
            self._release()
