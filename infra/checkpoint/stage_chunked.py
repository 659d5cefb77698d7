"""A chunked save's digests in one pass over its bytes: each chunk copied into the staging buffer (in the
stall) or read where it is staged (in the background), and hashed while it is in the core's cache.

A chunked save needs the digest of every chunk (its identity: what is linked, what written) and, for each
pack it writes, the pack's own digests. Hashing the chunks in one pass and each pack in another as it is
written read the state from memory twice; hashing is bound by that read here, not by the hash (xxh3 at
about 50 GB/s per core on bytes in the cache, 12 GB/s on bytes read from memory). Here each chunk is
hashed right after its copy, and so is the pack it goes into if every chunk of the save is new (full
training): the packs then are the distinct chunks in tensor order, cut every ``PACK_BYTES``
(``packs.cut``), each named by the digest of its chunk list. A pack the save then writes under such a
name is made of exactly those chunks, and is written as hashed (``payload.Prehashed``); any other (one
after a chunk stored once that repeats a large one, or where chunks are carried or linked) is hashed as it
is written. Small chunks that repeat (an optimizer's ``step`` of every parameter) are found by their bytes
before the packs are cut, so they shift no pack. Where most chunks are expected unchanged (``all_new``
false: the previous save wrote under half its bytes), no pack is hashed ahead.

The work is cut into those would-be packs, taken in turn by ``workers`` threads (``parallel.run_all``;
the copy, xxh3 and CRC32C all release the GIL). The digests are of the staged bytes, which the writes then
send unchanged.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rewind.infra import parallel
from rewind.infra.checkpoint import stage_hashed
from rewind.infra.checkpoint.staging import Parts, Staged, StagingBuffer
from rewind.infra.format import chunked, packs, tensorfile
from rewind.infra.format.digest import FileDigest, Hasher
from rewind.infra.format.payload import Prehashed
from rewind.infra.format.store import Hashed

BLOCK = stage_hashed.BLOCK  # copied, then hashed while it is in the core's cache
SMALL = 4096  # a chunk of at most this many bytes is compared by its bytes with the others that small


@dataclass(frozen=True, slots=True)
class _Piece:
    """One chunk: where it is in the save, its staged bytes, and (in the stall) where to copy them from."""

    key: chunked.ChunkKey
    view: memoryview  # its bytes in the staged tensor
    whole: memoryview  # the staged tensor's bytes, ``view`` at ``at``
    at: int
    dst: int  # the address of ``view``
    src: int  # the address to copy it from; 0: staged already

    def copy(self, at: int, n: int) -> None:
        if self.src:
            ctypes.memmove(self.dst + at, self.src + at, n)


def stage_and_hash(
    staging: StagingBuffer, parts: Parts, *, workers: int, all_new: bool
) -> tuple[Staged, Prehashed]:
    """``parts`` staged and their chunks hashed, each right after its copy, on ``workers`` threads; the
    would-be packs too where ``all_new``. A state with a tensor a copy of bytes does not stage exactly is
    staged first (``StagingBuffer.stage``), then hashed."""
    if not stage_hashed.plain(parts):
        staged = staging.stage(parts)
        staged.ready()
        return staged, hash_staged(staged.parts, workers=workers, all_new=all_new)
    places = staging.places(parts)
    return Staged(places), _hashed(_pieces(places, parts), workers, all_new)


def hash_staged(staged: Parts, *, workers: int, all_new: bool) -> Prehashed:
    """The chunks of ``staged`` (the staging buffer's tensors) hashed in place; the would-be packs too
    where ``all_new``. Nothing for a state whose tensors are not all on the CPU and contiguous: its chunks
    are hashed as the index is made."""
    if not stage_hashed.plain(staged):
        return Prehashed()
    return _hashed(_pieces(staged, None), workers, all_new)


def _pieces(places: Parts, sources: Parts | None) -> list[_Piece]:
    """Every chunk of the save, in the order the index lists them (``chunked.ordered``)."""
    out: list[_Piece] = []
    for part, name, t in chunked.ordered(places):
        whole = tensorfile.byte_view(t)
        row_bytes, ranges = chunked.grid(t.shape, len(whole))
        src = sources[part][name].data_ptr() if sources is not None else 0
        for a, b in ranges:
            lo, hi = a * row_bytes, b * row_bytes
            out.append(
                _Piece((part, name, a), whole[lo:hi], whole, lo, t.data_ptr() + lo, src + lo if src else 0)
            )
    return out


def _hashed(pieces: list[_Piece], workers: int, all_new: bool) -> Prehashed:
    distinct, repeats = _small_repeats(pieces)
    units = list(packs.cut(distinct, lambda p: len(p.view)))
    calls = [functools.partial(_hash_unit, u, all_new) for u in units]
    done = parallel.run_all(calls, workers=workers, name="rewind-stage")
    chunks: dict[chunked.ChunkKey, str] = {}
    files: dict[str, Hashed] = {}
    for unit, (digests, pack) in zip(units, done, strict=True):
        chunks.update(zip((p.key for p in unit), digests, strict=True))
        if pack is not None:
            group = [packs.Chunk(d, p.view, p.whole, p.at) for p, d in zip(unit, digests, strict=True)]
            files[packs.Pack(packs.pack_name(digests), pack.size).path] = Hashed(
                packs.pack_writer(group), pack
            )
    chunks.update((key, chunks[first]) for key, first in repeats.items())
    return Prehashed(files=files, chunks=chunks)


def _small_repeats(pieces: list[_Piece]) -> tuple[list[_Piece], dict[chunked.ChunkKey, chunked.ChunkKey]]:
    """``pieces`` but the small ones whose staged bytes repeat an earlier one's (each copied here first, and
    mapped to that earlier one): the distinct chunks in order, as the index stores them."""
    first: dict[bytes, chunked.ChunkKey] = {}
    distinct: list[_Piece] = []
    repeats: dict[chunked.ChunkKey, chunked.ChunkKey] = {}
    for p in pieces:
        if len(p.view) <= SMALL:
            p.copy(0, len(p.view))
            p = replace(p, src=0)  # staged now
            seen = first.setdefault(bytes(p.view), p.key)
            if seen != p.key:
                repeats[p.key] = seen
                continue
        distinct.append(p)
    return distinct, repeats


def _hash_unit(unit: Sequence[_Piece], with_pack: bool) -> tuple[list[str], FileDigest | None]:
    """Each chunk of ``unit`` copied (where it has a source) and hashed a block at a time, each block into
    the pack's digests too while it is in the cache (``with_pack``)."""
    pack = Hasher() if with_pack else None
    digests: list[str] = []
    for p in unit:
        h = Hasher(with_crc=False)
        for at in range(0, len(p.view), BLOCK):
            n = min(BLOCK, len(p.view) - at)
            p.copy(at, n)
            block = p.view[at : at + n]
            h.update(block)
            if pack is not None:
                pack.update(block, cached=n)
        digests.append(h.result().xxh3)
    return digests, pack.result() if pack is not None else None
