"""The storage tier interface: the handful of methods every tier implements.

Like litestream's ReplicaClient: put, open (read), stat, list, delete. Keys are
``/``-separated paths below the tier's root. Every error a tier raises is one of
the classes below, classified once as transient (retry) or permanent.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from rewind.infra.errors import ConfigError, NotFoundError, RewindError, TransientError, is_transient


class ObjectNotFound(NotFoundError):
    """``stat``/``open`` of a key that does not exist (``delete`` of one is not an error)."""


class UploadGone(ObjectNotFound):
    """An upload in parts no longer there (``NoSuchUpload``): completed or aborted by another sender, or
    completed by a completion whose answer was lost (its retry finds the upload gone)."""


class AlreadyExists(RewindError):
    """``put`` of a key that exists: tiers never overwrite."""


class TierUnavailable(TransientError):
    """The tier cannot be reached right now (endpoint down, timeout, 5xx, throttling)."""


class TierAccessDenied(RewindError):
    """Missing or wrong credentials, or no permission: retrying will not help."""


class TierConfigError(ConfigError):
    """A target that cannot work: malformed URI, missing bucket."""


class ChecksumModeMismatch(TierConfigError):
    """The server refused a checksum on an upload in parts begun without one (or the other way round)."""


class DigestRefused(TierUnavailable):
    """The server found the bytes it got are not those the request's checksum names (``BadDigest``): sent
    again, they may be."""


class CompletionRefused(DigestRefused):
    """An upload in parts whose parts the server will not complete as the whole file's checksum names."""


# Errors that say nothing about a copy's bytes: a copy that raised one is unverifiable for now, never
# corrupt. The one list the restore executor and the scrub both judge by.
UNREADABLE_ERRORS: tuple[type[Exception], ...] = (OSError, TransientError, TierAccessDenied, TierConfigError)


class DiskWriteError(RewindError):
    """A disk Rewind was writing refused the write (full, over quota, read-only, no permission): the local
    tier while a copy was fetched into it, or a filesystem tier while a copy was replicated onto it. The
    disk's fault, never the copy being read, so nothing is recorded against that copy, and nothing
    half-written is registered."""


class DiskWriteUnavailable(DiskWriteError, TransientError):
    """A write failed with an error that may go away by itself (EIO, EAGAIN, EBUSY)."""


_WHAT_TO_DO = {
    errno.ENOSPC: "free space there and retry",
    errno.EDQUOT: "free space or raise the quota there and retry",
    errno.EROFS: "it is mounted read-only",
    errno.EACCES: "this user may not write there",
    errno.EPERM: "this user may not write there",
}


def disk_write_error(exc: OSError, disk: str, source: str | None = None) -> DiskWriteError:
    """One line: ``disk`` (what and where: "the local disk at /ckpt/run") could not be written, what it
    said, what to do, and, given ``source``, that the copy read from there is not at fault."""
    why = exc.strerror or str(exc)
    hint = _WHAT_TO_DO.get(exc.errno or 0, "")
    on = f" ({exc.filename})" if exc.filename else ""
    message = (
        f"{disk} could not be written: {why}{on}"
        + (f"; {hint}" if hint else "")
        + (f"; the copy at {source} is not at fault and stays as it was" if source else "")
    )
    return (DiskWriteUnavailable if is_transient(exc) else DiskWriteError)(message)


class SourceFailed(Exception):
    """An error reading the bytes being copied, carried past the writes it must not be blamed on; the
    function that moves the bytes raises ``error`` itself, so this never leaves it."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class NotCopied(RewindError):
    """A server-side ``copy`` the tier did not make: the source's bytes are not the ones asked for, or the
    object is too large to copy in one request. Nothing is left at the destination; send the bytes instead."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    crc32c: str | None  # base64, as S3 reports it; None when the tier does not know


class Tier(Protocol):
    name: str  # "shared" or "offsite"
    uri: str
    checksums: bool  # does ``stat`` report a checksum the server computed (S3) or only a size

    def check(self) -> None:
        """Fail fast with one clear error: target missing or not writable, credentials wrong, endpoint down."""
        ...

    def put(self, key: str, src: Path, *, crc32c: str) -> int:
        """Store ``src`` under ``key``; returns bytes sent. Raises AlreadyExists; resumes a partial upload."""
        ...

    def put_bytes(self, key: str, data: bytes, *, crc32c: str) -> None:
        """Store a small object (the manifest) under ``key``; raises AlreadyExists."""
        ...

    def copy(self, src_key: str, dst_key: str, *, crc32c: str) -> None:
        """Copy ``src_key`` to ``dst_key`` on the tier itself, no bytes through this process.

        Raises ObjectNotFound (source gone), AlreadyExists (destination taken), NotCopied. Trusted
        exactly as much as a ``put``: the caller still holds the result to its size and CRC32C.
        """
        ...

    def open(self, key: str) -> BinaryIO:
        """A readable stream of the object; raises ObjectNotFound (and, on a filesystem, ``files.NotAFile``
        for what is not a regular file inside its checkpoint's directory: never opened)."""
        ...

    def capacity(self) -> int | None:
        """The most bytes one object on this tier can hold (a filesystem's size); None where it is not known."""
        ...

    def stat(self, key: str) -> ObjectInfo:
        """Size and server-side checksum, without reading the data; raises ObjectNotFound."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        ...

    def abandon(self, prefix: str) -> int:
        """Let go of uploads under ``prefix`` that never finished (S3 keeps their parts, and bills them, until
        aborted); how many. Called when a copy is deleted."""
        ...
