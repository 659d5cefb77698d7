"""Stage and hash in one pass: each block of the state copied into the staging buffer, then hashed while it
is still in the core's cache, on every core.

Each tensor file of the plain format is a stream: its header, then its tensors' bytes in file order, which
lie back to back in the staging buffer. A thread owns a file (the largest first) and goes through its blocks
in order: it copies each (``BLOCK`` bytes) and hashes it (xxh3 and CRC32C) while it is in the cache. A thread
with no file left takes blocks from the end of the file with the most still to do: it copies each and
computes its CRC32C; the owner, when it gets there, hashes it by xxh3 alone and combines the CRC
(``Hasher.extend``). So the copy and both digests are spread over the cores however unequal the files are,
and each byte is read from memory once for the copy, not again for the hash.

Each file is then written from the bytes hashed: its header, then its body as one view of the buffer
(``store.Hashed``), so the persist neither lays the file out again nor hashes it.

Only for tensors a plain copy of bytes stages exactly (``plain``): dense, contiguous, on the CPU, neither
conjugated nor negated; anything else is staged by ``StagingBuffer.stage`` and hashed after.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO

import torch

from rewind.infra.checkpoint.staging import Parts, Staged, StagingBuffer
from rewind.infra.format import payload, store, tensorfile
from rewind.infra.format.digest import FileDigest, Hasher, crc32c

BLOCK = 1 << 20  # copied, then hashed while it is in the core's cache (a fraction of its L2)


@dataclass(frozen=True, slots=True)
class _Block:
    """About ``BLOCK`` bytes of a file that lie back to back in the staging buffer (small tensors together,
    a large one in pieces), and the copies that put them there."""

    copies: tuple[tuple[int, int, int], ...]  # (where to, where from, bytes)
    staged: memoryview  # the bytes, once copied, for the digests

    def copy(self) -> None:
        for dst, src, n in self.copies:
            ctypes.memmove(dst, src, n)


@dataclass(slots=True)
class _Stream:
    """One file: its header, then its blocks in file order, which make up ``body`` (the file's bytes after
    its header, in the buffer). Blocks from ``back`` on are taken by helpers."""

    name: str
    head: bytes
    body: memoryview
    blocks: list[_Block]
    back: int = 0
    front: int = 0  # the owner's next block: never taken by a helper
    taken: dict[int, threading.Event] = field(default_factory=dict)
    crcs: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.back = len(self.blocks)

    def fresh(self) -> _Stream:
        """The same file, no block taken yet."""
        return _Stream(self.name, self.head, self.body, self.blocks)

    def file(self, digest: FileDigest) -> store.Hashed:
        """The file as the persist writes it: the bytes hashed, as they lie in the buffer."""
        head, body = self.head, self.body

        def fill(out: BinaryIO) -> None:
            out.write(head)
            if len(body):
                out.write(body)

        return store.Hashed(fill, digest)


def plain(parts: Parts) -> bool:
    """Whether every tensor of ``parts`` is staged exactly by copying its bytes."""
    return all(
        t.device.type == "cpu"
        and t.layout is torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        for ts in parts.values()
        for t in ts.values()
    )


def stage_and_hash(
    staging: StagingBuffer, parts: Parts, *, workers: int
) -> tuple[Staged, dict[str, store.Hashed]]:
    """``parts`` (``plain``) copied into ``staging``, and their tensor files as the plain format writes them
    from there, with their digests, on ``workers`` threads."""
    places = staging.places(parts)
    addresses = tuple((part, name, t.data_ptr()) for part, ts in parts.items() for name, t in ts.items())
    streams = [
        stream.fresh()
        for stream in staging.derived(addresses, lambda: _streams(parts, places))  # the same while the job's
    ]  # tensors stay where they are: made at the first save, and again only when one moved
    lock = threading.Lock()
    digests: dict[str, FileDigest] = {}
    queue = list(streams)
    others = workers - 1 if streams else 0
    if others <= 0:
        _work(queue, streams, lock, digests)
    else:
        with ThreadPoolExecutor(max_workers=others, thread_name_prefix="rewind-stage") as pool:
            helping = [pool.submit(_work, queue, streams, lock, digests) for _ in range(others)]
            _work(queue, streams, lock, digests)  # the calling thread is one of the workers
            for done in helping:
                done.result()
    return Staged(places), {s.name: s.file(digests[s.name]) for s in streams}


def _streams(parts: Parts, places: Mapping[str, Mapping[str, torch.Tensor]]) -> list[_Stream]:
    """Each part's file, the one with the most blocks first."""
    return sorted(
        (_stream(part, parts[part], places[part]) for part in parts if parts[part]),
        key=lambda s: -len(s.blocks),
    )


def _stream(part: str, tensors: Mapping[str, torch.Tensor], places: Mapping[str, torch.Tensor]) -> _Stream:
    """``part``'s file: its header, then its tensors' bytes in file order, which lie back to back in the
    buffer, in blocks of about ``BLOCK`` bytes."""
    head, order = tensorfile.layout(places)
    copies: list[tuple[int, int, int]] = []
    for name in order:
        src, dst = tensors[name], places[name]
        n = src.numel() * src.element_size()
        copies.extend(
            (dst.data_ptr() + at, src.data_ptr() + at, min(BLOCK, n - at)) for at in range(0, n, BLOCK)
        )
    placed = [places[name] for name in order if places[name].numel()]  # an empty one is not in the buffer
    if not copies:
        return _Stream(payload.tensor_file(part), head, memoryview(b""), [])
    body = _body(placed[0], sum(n for _, _, n in copies))
    return _Stream(payload.tensor_file(part), head, body, _blocks(copies, placed[0], body))


def _body(first: torch.Tensor, nbytes: int) -> memoryview:
    """The ``nbytes`` of the buffer from ``first``'s place."""
    at = first.data_ptr() - first.untyped_storage().data_ptr()
    region = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage(), at, (nbytes,), (1,))
    return tensorfile.byte_view(region)


def _blocks(copies: list[tuple[int, int, int]], first: torch.Tensor, staged: memoryview) -> list[_Block]:
    """``copies`` (back to back in the buffer from ``first``'s place: ``staged``) grouped into blocks of at
    least ``BLOCK`` bytes (the last may be less)."""
    blocks: list[_Block] = []
    group: list[tuple[int, int, int]] = []
    start = size = 0  # the group's first byte, from ``first``'s place, and its bytes
    for dst, src, n in copies:
        if dst != first.data_ptr() + start + size:
            raise RuntimeError("staged tensors are not back to back in the buffer")
        group.append((dst, src, n))
        size += n
        if size >= BLOCK:
            blocks.append(_Block(tuple(group), staged[start : start + size]))
            start, size, group = start + size, 0, []
    if group:
        blocks.append(_Block(tuple(group), staged[start : start + size]))
    return blocks


def _work(
    queue: list[_Stream], streams: list[_Stream], lock: threading.Lock, out: dict[str, FileDigest]
) -> None:
    """Own the next file no thread owns, until none is left; then help with the others' ends."""
    while True:
        with lock:
            if not queue:
                break
            stream = queue.pop(0)
        out[stream.name] = _own(stream, lock)
    while _help(streams, lock):
        pass


def _own(s: _Stream, lock: threading.Lock) -> FileDigest:
    h = Hasher()
    h.update(s.head)
    for i, block in enumerate(s.blocks):
        with lock:
            taken = s.taken.get(i)
            if taken is None:
                s.front = i + 1
        if taken is None:
            block.copy()
            h.update(block.staged, cached=len(block.staged))  # in the cache as one: both digests over it
            continue
        taken.wait()  # the helper copying it never waits on anything
        if i not in s.crcs:
            raise RuntimeError(f"{s.name}: block {i} was not staged")
        h.extend(block.staged, s.crcs[i])
    return h.result()


def _help(streams: list[_Stream], lock: threading.Lock) -> bool:
    """Copy one block from the end of the file with the most left to do, and compute its CRC32C; False when
    no file has a block its owner has not reached."""
    with lock:
        s = max(streams, key=lambda s: s.back - s.front, default=None)
        if s is None or s.back - s.front < 2:  # the owner's next block stays its own
            return False
        s.back -= 1
        i = s.back
        s.taken[i] = done = threading.Event()
    block = s.blocks[i]
    try:
        block.copy()
        s.crcs[i] = crc32c(block.staged)
    finally:
        done.set()
    return True
