"""KV-cache blocks: token blocks named by a chained hash of their prefix, kept in tiers, checked on read.

A block holds the keys and values of every layer for up to ``BLOCK_TOKENS`` tokens. Its
name is xxh3-128 of (the previous block's name, its own token ids), the way vLLM's prefix
caching names blocks: one prefix gives one chain of names on every instance. Its bytes
are a small JSON header and the raw tensors (no pickle); their xxh3-128 digest is recorded
with the conversation in the catalog, and ``decode`` refuses bytes that do not hash to it,
so a damaged block is recomputed, never used.

Tiers: process memory, then a node-local directory, optionally a shared tier; each keeps a
byte budget and evicts the least often used blocks first.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
import xxhash

from infra.errors import ConfigError, CorruptCheckpoint, MalformedFile
from infra.format.digest import hash_bytes
from infra.format.verify import Finding, Problem

BLOCK_TOKENS = 64
_HEADER = struct.Struct("<I")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_HEADER = 1 << 16


def block_names(tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[str]:
    """The chained name of each block of ``tokens`` (the last one may be partial)."""
    names, parent = [], ""
    for start in range(0, len(tokens), block_tokens):
        h = xxhash.xxh3_128(parent.encode())
        h.update(
            struct.pack(
                f"<{len(tokens[start : start + block_tokens])}q", *tokens[start : start + block_tokens]
            )
        )
        parent = h.hexdigest()
        names.append(parent)
    return names


def encode(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> bytes:
    """One block's bytes: header (dtype, per-layer shape) and each layer's keys then values, raw."""
    first = keys[0]
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ConfigError(f"KV blocks hold {sorted(_DTYPES)}, not {dtype}")
    header = json.dumps({"dtype": dtype, "shapes": [list(k.shape) for k in keys]}).encode()
    parts = [_HEADER.pack(len(header)), header]
    for k, v in zip(keys, values, strict=True):
        parts += [
            k.contiguous().view(torch.uint8).numpy().tobytes(),
            v.contiguous().view(torch.uint8).numpy().tobytes(),
        ]
    return b"".join(parts)


def digest(data: bytes) -> str:
    return hash_bytes(data).xxh3


def decode(data: bytes, expected: str, name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The block's tensors, only if ``data`` hashes to ``expected``; ``CorruptCheckpoint`` otherwise."""
    if digest(data) != expected:
        raise CorruptCheckpoint(
            f"kv block {name}", [Finding(Problem.DIGEST, name, "bytes do not match the recorded digest")]
        )
    (size,) = _HEADER.unpack_from(data)
    header = json.loads(data[_HEADER.size : _HEADER.size + min(size, MAX_HEADER)])
    dtype = _DTYPES[header["dtype"]]
    pos = _HEADER.size + size
    keys, values = [], []
    for shape in header["shapes"]:
        n = int(torch.Size(shape).numel()) * torch.tensor([], dtype=dtype).element_size()
        keys.append(torch.frombuffer(bytearray(data[pos : pos + n]), dtype=dtype).reshape(shape))
        values.append(torch.frombuffer(bytearray(data[pos + n : pos + 2 * n]), dtype=dtype).reshape(shape))
        pos += 2 * n
    return keys, values


class BlockStore(Protocol):
    name: str

    def get(self, block: str) -> bytes | None: ...

    def put(self, block: str, data: bytes) -> None: ...


class MemoryBlocks:
    """Blocks in process memory, within ``budget`` bytes; the least often used go first."""

    name = "memory"

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._data: dict[str, bytes] = {}
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, block: str) -> bytes | None:
        with self._lock:
            data = self._data.get(block)
            if data is not None:
                self._hits[block] += 1
            return data

    def put(self, block: str, data: bytes) -> None:
        with self._lock:
            self._data[block] = data
            self._hits.setdefault(block, 1)
            self._evict()

    def _evict(self) -> None:
        held = sum(len(d) for d in self._data.values())
        for victim in sorted(self._data, key=lambda b: self._hits[b]):
            if held <= self.budget:
                return
            held -= len(self._data.pop(victim))
            self._hits.pop(victim)


class DiskBlocks:
    """Blocks as files under ``root`` (node-local disk or shared memory), within ``budget`` bytes."""

    name = "disk"

    def __init__(self, root: Path, budget: int) -> None:
        self.root, self.budget = Path(root), budget
        self.root.mkdir(parents=True, exist_ok=True)
        self._hits: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, block: str) -> Path:
        if len(block) != 32 or any(c not in "0123456789abcdef" for c in block):
            raise MalformedFile(f"not a block name: {block[:40]!r}")
        return self.root / block[:2] / block

    def get(self, block: str) -> bytes | None:
        try:
            data = self._path(block).read_bytes()
        except FileNotFoundError:
            return None
        with self._lock:
            self._hits[block] = self._hits.get(block, 0) + 1
        return data

    def put(self, block: str, data: bytes) -> None:
        path = self._path(block)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{block}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a reader sees the old block or the new one, never half
        with self._lock:
            self._hits.setdefault(block, 1)
            self._evict()

    def _evict(self) -> None:
        files = {p.name: p for p in self.root.glob("??/*") if not p.name.startswith(".")}
        sizes = {b: p.stat().st_size for b, p in files.items()}
        held = sum(sizes.values())
        for victim in sorted(files, key=lambda b: self._hits.get(b, 0)):
            if held <= self.budget:
                return
            files[victim].unlink(missing_ok=True)
            held -= sizes[victim]
            self._hits.pop(victim, None)


class TieredBlocks:
    """The nearest tier first; a hit further out is copied into the nearer tiers; writes go to every tier."""

    def __init__(self, tiers: Sequence[BlockStore]) -> None:
        self.tiers = list(tiers)

    def get(self, block: str) -> tuple[bytes, str] | None:
        for i, tier in enumerate(self.tiers):
            data = tier.get(block)
            if data is not None:
                for nearer in self.tiers[:i]:
                    nearer.put(block, data)
                return data, tier.name
        return None

    def put(self, block: str, data: bytes) -> None:
        for tier in self.tiers:
            tier.put(block, data)
