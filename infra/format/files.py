"""Reading what a tier holds where a manifest names a file, without trusting what is there.

A checkpoint's files are regular files inside its directory, never larger than the
filesystem holding them. Anything else (a FIFO, a device, a socket, a link leading
out of the directory, a sparse file claiming more bytes than the disk has) is damage:
it is refused before it is opened, so that opening it cannot block (a FIFO with no
writer), read a device, or hash zeros for hours. A directory is what it always was:
its size differs from the entry's, and opening it is ``IsADirectoryError``. A link
that stays inside the directory is followed (Rewind writes none; it harms nothing).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from rewind.infra.errors import MalformedFile

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


class NotAFile(MalformedFile):
    """Where a file should be lies something that cannot be one: never opened, never read (damage, not an I/O
    error). The message is one line naming the path and what is there instead."""


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _inside(base: Path, rel: str) -> str:
    """The real path of ``base/rel``, if no link takes it out of ``base``; else ``NotAFile``.

    ``FileNotFoundError`` when nothing is there (a dangling link inside ``base`` included).
    """
    path = os.path.join(base, rel)
    real = os.path.realpath(path)
    top = os.path.realpath(base)
    if os.path.commonpath([real, top]) != top:
        raise NotAFile(f"{path} is a symbolic link leading out of {base} (to {real}): not followed")
    return real


def _regular(base: Path, rel: str, *, opening: bool) -> tuple[str, os.stat_result]:
    real = _inside(base, rel)
    st = os.lstat(real)
    if stat.S_ISDIR(st.st_mode):
        if opening:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.path.join(base, rel))
    elif not stat.S_ISREG(st.st_mode):
        raise NotAFile(f"{os.path.join(base, rel)} is {_kind(st.st_mode)}, not a regular file: never opened")
    return real, st


def stat_regular(base: Path, rel: str) -> os.stat_result:
    """``lstat`` of what ``rel`` names below ``base``: a regular file (or a directory) inside ``base``, else
    ``NotAFile``."""
    return _regular(base, rel, opening=False)[1]


def open_regular(base: Path, rel: str, *, buffering: int = -1) -> BinaryIO:
    """Open ``base/rel`` for reading, only if it is a regular file inside ``base``.

    Checked before opening, and again on what was opened (opened non-blocking, without following a final
    link, so a FIFO swapped in meanwhile neither blocks nor is read). ``FileNotFoundError`` when absent.
    """
    real, before = _regular(base, rel, opening=True)
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise NotAFile(f"{os.path.join(base, rel)} was replaced while being opened: not read")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def capacity(path: Path) -> int | None:
    """The most bytes the filesystem holding ``path`` can hold (its size), or None where it cannot be told."""
    with contextlib.suppress(OSError):
        vfs = os.statvfs(path)
        if vfs.f_blocks > 0:
            return vfs.f_blocks * vfs.f_frsize
    return None


def beyond(size: int, holds: int | None) -> str | None:
    """Why a file of ``size`` bytes cannot lie on a filesystem of ``holds`` bytes, or None when it can."""
    if holds is None or size <= holds:
        return None
    return f"claims {size} bytes, more than the filesystem holding it can hold ({holds} bytes): not read"
