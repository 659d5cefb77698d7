"""The storage tier interface: the handful of methods every tier implements.

Like litestream's ReplicaClient: put, open (read), stat, list, delete. Keys are
``/``-separated paths below the tier's root. Every error a tier raises is one of
the classes below, classified once as transient (retry) or permanent.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from infra.errors import ConfigError, NotFoundError, RewindError, TransientError


class ObjectNotFound(NotFoundError):
    """``stat``/``open`` of a key that does not exist (``delete`` of one is not an error)."""


class AlreadyExists(RewindError):
    """``put`` of a key that exists: tiers never overwrite."""


class TierUnavailable(TransientError):
    """The tier cannot be reached right now (endpoint down, timeout, 5xx, throttling)."""


class TierAccessDenied(RewindError):
    """Missing or wrong credentials, or no permission: retrying will not help."""


class TierConfigError(ConfigError):
    """A target that cannot work: malformed URI, missing bucket."""


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
        """A readable stream of the object; raises ObjectNotFound."""
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
