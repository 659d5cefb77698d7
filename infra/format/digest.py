"""Content digests computed while bytes stream past.

xxh3-128 is the identity of a file (about 20 GB/s per core, never the bottleneck);
CRC32C rides along because S3 servers compute it too, which lets an off-site copy
be checked without downloading it. It is ``fastcrc``'s (carry-less multiply folding:
about 50 GB/s per core in cache here, twice the ``crc32`` instruction's 25 GB/s that
the ``crc32c`` package is bound by); both release the GIL.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import xxhash
from fastcrc import crc32 as _crc32

from rewind.infra import progress, throttle

DIGEST_ALGORITHM = "xxh3-128"
CHUNK = 8 << 20
CACHED = 256 << 10  # a piece hashed by both digests in turn fits in a core's L2 cache


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """The CRC32C of ``data``, continuing ``crc``."""
    return _crc32.iscsi(data, crc)


_CRC32C_POLY = 0x82F63B78  # reflected
_X0 = 1 << 31  # the polynomial 1, reflected


def _mult_mod_p(a: int, b: int) -> int:
    """``a`` times ``b`` modulo the CRC32C polynomial (reflected, as zlib's ``multmodp``)."""
    m, p = _X0, 0
    while m and a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return p


@functools.lru_cache(maxsize=64)  # a copy's blocks mostly share one length
def _x_power_8n(n: int) -> int:
    """x to the power 8 ``n`` (``n`` bytes of zeros) modulo the CRC32C polynomial."""
    p, square = _X0, _X0 >> 8  # x^8: one byte
    while n:
        if n & 1:
            p = _mult_mod_p(square, p)
        square = _mult_mod_p(square, square)
        n >>= 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of ``a`` then ``b`` from the CRC32C of each (``b``'s from 0) and ``b``'s length."""
    return _mult_mod_p(_x_power_8n(len_b), crc_a) ^ crc_b


def crc32c_b64(value: int) -> str:
    """A CRC32C as S3 reports it: base64 of its 4 bytes, big-endian."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


@dataclass(frozen=True, slots=True)
class FileDigest:
    size: int
    xxh3: str  # hex
    crc32c: str  # base64 of the big-endian 4 bytes, the form S3 reports
    segments: tuple[str, ...] = ()  # xxh3-128 of each ``segment`` bytes in turn, where asked for

    def as_dict(self) -> dict[str, int | str]:
        return {"size": self.size, "xxh3": self.xxh3, "crc32c": self.crc32c}


class Hasher:
    """Accumulates size and digests over a byte stream.

    Verification compares xxh3 only and passes ``with_crc=False`` to halve the cost. ``segment``: the xxh3
    of every ``segment`` bytes in turn as well (``rewind.infra.format.segments``), a second pass over each
    piece while it is in the cache.
    """

    __slots__ = ("_crc", "_done", "_seg", "_segment", "_size", "_with_crc", "_xxh")

    def __init__(self, *, with_crc: bool = True, segment: int = 0) -> None:
        self._xxh = xxhash.xxh3_128()
        self._crc = 0
        self._size = 0
        self._with_crc = with_crc
        self._segment = segment
        self._seg = xxhash.xxh3_128() if segment else None
        self._done: list[str] = []

    def update(self, data: bytes | bytearray | memoryview, *, cached: int = CACHED) -> None:
        """``data`` into the digests, each over ``cached`` bytes in turn: pieces of a stream that fit in a
        core's cache, or more where the caller just put them there (``stage_hashed``: a block it copied)."""
        if cached <= 0:
            raise ValueError(f"cached={cached}: the pieces hashed in turn must hold at least one byte")
        with memoryview(data) as whole, whole.cast("B") as view:
            if not self._with_crc and not self._segment:
                self._xxh.update(view)
            else:  # every digest over each piece while it is in the CPU's cache, not twice over all of it
                for at in range(0, len(view), cached):
                    with view[at : at + cached] as piece:
                        self._xxh.update(piece)
                        if self._with_crc:
                            self._crc = crc32c(piece, self._crc)
                        if self._segment:
                            self._segments(piece, self._size + at)
            self._size += len(view)

    def extend(self, data: bytes | bytearray | memoryview, crc: int) -> None:
        """``data`` whose CRC32C (from 0) is known already, computed where it was copied: hashed by xxh3
        alone, its CRC32C combined with the stream's (``crc32c_combine``)."""
        if self._segment:
            raise ValueError("a hasher of segments takes every byte through update")
        with memoryview(data) as whole, whole.cast("B") as view:
            self._xxh.update(view)
            if self._with_crc:
                self._crc = crc32c_combine(self._crc, crc, len(view))
            self._size += len(view)

    def _segments(self, piece: memoryview, offset: int) -> None:
        """``piece`` (at ``offset`` in the stream) into the segment digests, a segment closed at its end."""
        seg = self._seg
        assert seg is not None  # made with the segment size
        at = 0
        while at < len(piece):
            room = self._segment - (offset + at) % self._segment
            with piece[at : at + room] as part:
                seg.update(part)
                at += len(part)
            if (offset + at) % self._segment == 0:
                self._done.append(seg.hexdigest())
                seg.reset()

    def result(self) -> FileDigest:
        crc = crc32c_b64(self._crc) if self._with_crc else ""
        segments: tuple[str, ...] = ()
        if self._seg is not None:
            tail = [self._seg.hexdigest()] if self._size % self._segment else []
            segments = (*self._done, *tail)
        return FileDigest(size=self._size, xxh3=self._xxh.hexdigest(), crc32c=crc, segments=segments)


class HashingWriter:
    """A write-only file wrapper that hashes exactly the bytes it writes (and reports them as progress).

    Every file Rewind writes goes through one, so the job's write limit (``rewind.infra.throttle``) paces it here.
    """

    def __init__(self, raw: BinaryIO, *, segment: int = 0, hashed: bool = True) -> None:
        self._raw = raw
        self.hasher = Hasher(segment=segment)
        self._hashed = hashed  # False: the bytes were hashed before (``store.Hashed``); only counted
        self.count = 0
        self._throttle = throttle.for_writes()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._throttle is None:
            return self._write(data)
        view = memoryview(data).cast("B")  # paced in slices, so a whole tensor is not one burst
        written = 0
        for i in range(0, len(view), self._throttle.slice):
            piece = view[i : i + self._throttle.slice]
            self._throttle.take(len(piece))
            written += self._write(piece)
        return written

    def _write(self, data: bytes | bytearray | memoryview) -> int:
        if self._hashed:
            self.hasher.update(data)
        n = self._raw.write(data)
        self.count += n
        progress.advance(n)
        return n


class HashingReader:
    """Reads a file once, hashing and counting exactly the bytes read (and reporting them as progress)."""

    def __init__(self, raw: BinaryIO, hasher: Hasher) -> None:
        self._raw = raw
        self.hasher = hasher
        self.count = 0

    def fill(self, view: memoryview) -> bool:
        """Fill ``view`` completely; False if the file ended first."""
        pos = 0
        while pos < len(view):
            n = self._raw.readinto(view[pos:])  # type: ignore[attr-defined]
            if not n:
                return False
            self.hasher.update(view[pos : pos + n])
            self.count += n
            pos += n
            progress.advance(n)
        return True

    def skip(self, n: int) -> bool:
        """Read and hash ``n`` bytes nobody needs (padding, gaps); False if the file ended first."""
        scratch = memoryview(bytearray(min(n, CHUNK) or 1))
        while n > 0:
            if not self.fill(scratch[: min(n, len(scratch))]):
                return False
            n -= min(n, len(scratch))
        return True

    def finish(self, size: int) -> None:
        """Read on to ``size`` bytes, then one more if there is one: a shorter or longer file shows in ``count``.

        Never reads past ``size + 1``, so a file that keeps growing cannot keep the reader going.
        """
        if self.count < size:
            self.skip(size - self.count)
        if self.count == size:
            self.skip(1)

    def read_all(self, limit: int) -> bytes:
        """Up to ``limit`` bytes (and one more, counted, if the file is longer)."""
        buf = bytearray(limit)
        view = memoryview(buf)
        pos = 0
        while pos < limit and (n := self._raw.readinto(view[pos:])):  # type: ignore[attr-defined]
            self.hasher.update(view[pos : pos + n])
            pos += n
            progress.advance(n)
        self.count += pos
        self.finish(limit)
        return bytes(buf[:pos])


class HashingSink:
    """A write-only object that hashes what is written to it and keeps none of it (``store.hash_stream``)."""

    def __init__(self) -> None:
        self.hasher = Hasher()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.hasher.update(data)
        return memoryview(data).nbytes


def hash_bytes(data: bytes | bytearray | memoryview) -> FileDigest:
    h = Hasher()
    h.update(data)
    return h.result()


def hash_file(path: Path, *, with_crc: bool = True) -> FileDigest:
    h = Hasher(with_crc=with_crc)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.result()


def manifest_digest(raw: bytes) -> str:
    """What the catalog records for a manifest: SHA-256, so a forged manifest cannot be made to match.

    Manifests are a few KB; the cryptographic digest costs nothing here, unlike on data files.
    """
    return hashlib.sha256(raw).hexdigest()


def manifest_matches(raw: bytes, recorded: str) -> bool:
    """``raw`` is the manifest the catalog recorded. Catalogs before SHA-256 recorded xxh3-128 (32 hex)."""
    got = hash_bytes(raw).xxh3 if len(recorded) == 32 else manifest_digest(raw)
    return hmac.compare_digest(got, recorded)
