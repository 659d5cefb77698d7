"""A tier on a filesystem path (an NFS/Lustre mount shared by machines, or another local disk).

Objects are written to a temporary name, fsynced and linked into place with
``os.link``, which fails if the name exists: nothing is ever overwritten, and a
crash leaves only a temporary file. A ``copy`` on the tier is a hard link (one inode
shared by both names, like the chunked format's local dedup), its bytes read back
and checked before the name appears.

A write the disk refuses (full, over quota, read-only, no permission) is one
``DiskWriteError`` naming the tier's directory and what the disk said; its temporary
file is removed, and no name appears.

What is read is a regular file inside its checkpoint's directory (``<run>/<step>``
below the root), or it is not opened at all (``files.NotAFile``): a FIFO there
would block the reader forever, a link could lead anywhere.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from rewind.infra.format import direct, files
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import CHUNK, HashingWriter, hash_file
from rewind.infra.tiers.base import (
    AlreadyExists,
    DiskWriteError,
    NotCopied,
    ObjectInfo,
    ObjectNotFound,
    SourceFailed,
    TierConfigError,
    TierUnavailable,
    disk_write_error,
)


def root_path(uri: str) -> Path:
    """``file:///shared/ckpt`` or a plain absolute path."""
    path = uri.removeprefix("file://")
    if "://" in path or not path.startswith("/"):
        raise TierConfigError(f"a filesystem tier needs an absolute path or file:// URL, got {uri!r}")
    return Path(path)


def _publish(tmp: Path, dest: Path) -> None:
    """Give a finished temporary file its name; ``os.link`` refuses a name that exists."""
    try:
        os.link(tmp, dest)
    except FileExistsError as exc:
        raise AlreadyExists(f"{dest} already exists; replicas are never overwritten") from exc


def _drop(tmp: Path) -> None:
    """Remove a temporary file if one was made (on a read-only disk even a missing name cannot be unlinked)."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.lexists(tmp):
            tmp.unlink()


def _read(source: BinaryIO, n: int) -> bytes:
    """A read of what is being written: its error is the source's (``SourceFailed``), never the tier's disk's."""
    try:
        return source.read(n)
    except OSError as exc:
        raise SourceFailed(exc) from exc


class FileTier:
    name = "shared"
    checksums = False

    def __init__(self, uri: str) -> None:
        self.root = root_path(uri)
        self.uri = str(self.root)  # one spelling per tier: catalog rows compare it

    def _path(self, key: str) -> Path:
        return self.root / mf.contained(key)

    def _within(self, key: str) -> tuple[Path, str]:
        """The directory nothing read for ``key`` may lead out of (its checkpoint's), and the key below it."""
        parts = mf.contained(key).split("/")
        depth = 2 if len(parts) > 2 else 0  # <run>/<step>/<file...>: the checkpoint's directory
        return self.root.joinpath(*parts[:depth]), "/".join(parts[depth:])

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierUnavailable(f"shared tier {self.root} is not writable: {exc}") from exc

    def _unwritable(self, exc: OSError) -> DiskWriteError:
        return disk_write_error(exc, f"the {self.name} tier at {self.root}")

    def _write(self, key: str, source: BinaryIO | bytes) -> tuple[int, str]:
        dest = self._path(key)
        if dest.exists():
            raise AlreadyExists(f"{dest} already exists; replicas are never overwritten")
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with direct.NewFile(tmp) as raw:  # synced as it closes
                out = HashingWriter(raw)  # type: ignore[arg-type]  # a file that only writes
                if isinstance(source, bytes):
                    out.write(source)
                else:
                    while chunk := _read(source, CHUNK):
                        out.write(chunk)
            _publish(tmp, dest)
        except SourceFailed as failed:
            raise failed.error from None  # reading what was being written failed: as it said
        except OSError as exc:  # everything else here writes this tier's disk
            raise self._unwritable(exc) from exc
        finally:
            _drop(tmp)
        d = out.hasher.result()
        return d.size, d.crc32c

    def put(self, key: str, src: Path, *, crc32c: str) -> int:
        with open(src, "rb") as f:
            size, got = self._write(key, f)
        if got != crc32c:
            self._path(key).unlink(missing_ok=True)
            raise TierUnavailable(
                f"copy of {src} to {self._path(key)} changed in transit (crc32c {got} != {crc32c})"
            )
        return size

    def put_bytes(self, key: str, data: bytes, *, crc32c: str) -> None:
        self._write(key, data)

    def copy(self, src_key: str, dst_key: str, *, crc32c: str) -> None:
        """A hard link, no bytes written; held to ``crc32c`` as ``put`` holds what it writes.

        The link is made under a temporary name and its bytes (the inode the new name will
        share) are read back and checked before the name appears. Where no link can be made
        (another filesystem, too many links, links not supported) the bytes are copied, checked
        the same way. A source whose bytes differ is refused (``NotCopied``), nothing left behind.
        """
        src, dest = self._path(src_key), self._path(dst_key)
        if dest.exists():
            raise AlreadyExists(f"{dest} already exists; replicas are never overwritten")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unwritable(exc) from exc
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            try:
                files.stat_regular(*self._within(src_key))  # no link followed out, no FIFO linked
                os.link(src, tmp, follow_symlinks=False)
            except FileNotFoundError as exc:
                raise self._missing(src_key, exc) from exc
            except files.NotAFile as exc:
                raise NotCopied(f"{exc}; not linked") from exc
            except OSError:  # EXDEV, EMLINK, EPERM: no link here (a full or read-only disk: the copy says so)
                self._copy_bytes(src_key, dst_key, crc32c)
                return
            if not stat.S_ISREG(tmp.lstat().st_mode):  # a FIFO would block the read below forever
                raise NotCopied(f"{src} is not a regular file; not linked")
            got = hash_file(tmp).crc32c
            if got != crc32c:
                raise NotCopied(f"{src} is not the file asked for (crc32c {got} != {crc32c}); not linked")
            try:
                _publish(tmp, dest)
            except OSError as exc:
                raise self._unwritable(exc) from exc
        finally:
            _drop(tmp)

    def _copy_bytes(self, src_key: str, dst_key: str, crc32c: str) -> None:
        src = self._path(src_key)
        try:
            with self.open(src_key) as f:
                _, got = self._write(dst_key, f)
        except files.NotAFile as exc:
            raise NotCopied(f"{exc}; not copied") from exc
        if got != crc32c:
            self._path(dst_key).unlink(missing_ok=True)
            raise NotCopied(f"{src} is not the file asked for (crc32c {got} != {crc32c}); not copied")

    def _missing(self, key: str, exc: OSError) -> Exception:
        """A missing object, or a missing tier: an unmounted share must not read as 'every copy is gone'."""
        if not self.root.is_dir():
            return TierUnavailable(f"shared tier {self.root} does not exist (not mounted?)")
        return ObjectNotFound(f"{self._path(key)} does not exist")

    def open(self, key: str) -> BinaryIO:
        """The file at ``key``, if it is a regular file inside its checkpoint's directory (``files.NotAFile``
        otherwise, nothing opened)."""
        try:
            return files.open_regular(*self._within(key))
        except FileNotFoundError as exc:
            raise self._missing(key, exc) from exc

    def stat(self, key: str) -> ObjectInfo:
        """Its size, without following a link out of its checkpoint's directory (``files.NotAFile``)."""
        try:
            size = files.stat_regular(*self._within(key)).st_size
        except FileNotFoundError as exc:
            raise self._missing(key, exc) from exc
        return ObjectInfo(key, size, None)  # a filesystem keeps no checksum: deep verify reads it

    def capacity(self) -> int | None:
        return files.capacity(self.root)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return  # a tier that is not there holds nothing (never look above the root)
        base = self.root / prefix if prefix else self.root
        start = base if base.is_dir() else base.parent
        if not start.is_dir():
            return
        for p in sorted(start.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if p.is_file() and rel.startswith(prefix) and ".tmp-" not in p.name:
                yield ObjectInfo(rel, p.stat().st_size, None)

    def abandon(self, prefix: str) -> int:
        """Nothing to let go: an unfinished copy of a file is a ``.tmp-`` file ``delete`` of its directory removes."""
        return 0

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise self._unwritable(exc) from exc
        for parent in path.parents:  # drop directories the delete left empty, never the root
            if parent == self.root or not parent.is_relative_to(self.root):
                break
            try:
                parent.rmdir()
            except OSError:
                break
