"""KV-cache blocks: token blocks named by a chained hash of their prefix, kept in tiers, checked on read.

A block holds the keys and values of every layer for up to ``BLOCK_TOKENS`` tokens. Its
name is xxh3-128 of (the previous block's name, its own token ids), the way vLLM's prefix
caching names blocks, with the chain seeded by the model's identity (name, version,
weights digest): one prefix of one model gives one chain of names on every instance, and
blocks computed by other weights never match. Its bytes are a small JSON header and the
raw tensors (no pickle); their xxh3-128 digest is recorded with the conversation in the
catalog. A tier stores a block under its name and digest together, so a write never
replaces bytes another conversation recorded, and ``TieredBlocks.get`` hands out only
bytes that hash to the digest asked for: a damaged block is recomputed, never used.

Tiers: process memory and a node-local directory (local disk or /dev/shm), each within a
byte budget, evicting the least used blocks first (the block just written is never the one).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import xxhash

from rewind.infra.errors import ConfigError, MalformedFile
from rewind.infra.format import tensorfile
from rewind.infra.format.digest import hash_bytes

log = logging.getLogger("rewind.kv")
BLOCK_TOKENS = 64
_HEADER = struct.Struct("<I")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_HEADER = 1 << 16
_KEY = re.compile(r"^[0-9a-f]{32}-[0-9a-f]{32}$")


def block_names(tokens: Sequence[int], model_id: str, block_tokens: int = BLOCK_TOKENS) -> list[str]:
    """The chained name of each block of ``tokens`` under ``model_id`` (the last one may be partial)."""
    names, parent = [], xxhash.xxh3_128(f"rewind-kv:{model_id}:{block_tokens}".encode()).hexdigest()
    for start in range(0, len(tokens), block_tokens):
        chunk = tokens[start : start + block_tokens]
        h = xxhash.xxh3_128(parent.encode())
        h.update(struct.pack(f"<{len(chunk)}q", *chunk))
        parent = h.hexdigest()
        names.append(parent)
    return names


def encode(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> bytes:
    """One block's bytes: header (dtype, per-layer shape) and each layer's keys then values, raw."""
    dtype = str(keys[0].dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ConfigError(f"KV blocks hold {sorted(_DTYPES)}, not {dtype}")
    header = json.dumps({"dtype": dtype, "shapes": [list(k.shape) for k in keys]}).encode()
    parts = [_HEADER.pack(len(header)), header]
    for k, v in zip(keys, values, strict=True):
        for t in (k, v):
            parts.append(bytes(tensorfile.byte_view(t.detach().to("cpu"))))  # leaves the cache's tensors be
    return b"".join(parts)


def digest(data: bytes) -> str:
    return hash_bytes(data).xxh3


def decode(data: bytes) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors of a block whose bytes were proven against their recorded digest; ``MalformedFile``
    if even so they do not parse (a digest recorded for bytes Rewind did not write)."""
    try:
        (size,) = _HEADER.unpack_from(data)
        if size > MAX_HEADER:
            raise MalformedFile(f"KV block header of {size} bytes (at most {MAX_HEADER})")
        header = json.loads(data[_HEADER.size : _HEADER.size + size])
        dtype = _DTYPES[header["dtype"]]
        pos, width = _HEADER.size + size, torch.tensor([], dtype=dtype).element_size()
        keys, values = [], []
        for shape in header["shapes"]:
            n = int(torch.Size(shape).numel()) * width
            if pos + 2 * n > len(data):
                raise MalformedFile("KV block shorter than its header says")
            keys.append(torch.frombuffer(bytearray(data[pos : pos + n]), dtype=dtype).reshape(shape))
            values.append(
                torch.frombuffer(bytearray(data[pos + n : pos + 2 * n]), dtype=dtype).reshape(shape)
            )
            pos += 2 * n
    except (struct.error, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise MalformedFile(f"KV block does not parse: {exc}") from exc
    return keys, values


class BlockStore(Protocol):
    name: str

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...


class _Usage:
    """Hits and recency per key; the victims are the least used, oldest first, never ``keep``."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self._clock = 0

    def touch(self, key: str) -> None:
        self._clock += 1
        self.hits[key] = self.hits.get(key, 0) + 1
        self.last[key] = self._clock

    def victims(self, keys: Sequence[str], keep: str) -> list[str]:
        return sorted(
            (k for k in keys if k != keep), key=lambda k: (self.hits.get(k, 0), self.last.get(k, 0))
        )

    def forget(self, key: str) -> None:
        self.hits.pop(key, None)
        self.last.pop(key, None)


class MemoryBlocks:
    """Blocks in process memory, within ``budget`` bytes."""

    name = "memory"

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._data: dict[str, bytes] = {}
        self._held = 0
        self._usage = _Usage()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._data.get(key)
            if data is not None:
                self._usage.touch(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._held += len(data) - len(self._data.get(key, b""))
            self._data[key] = data
            self._usage.touch(key)
            for victim in self._usage.victims(list(self._data), keep=key):
                if self._held <= self.budget:
                    break
                self._held -= len(self._data.pop(victim))
                self._usage.forget(victim)


class DiskBlocks:
    """Blocks as files under ``root`` (node-local disk or /dev/shm, shared by a node's instances)."""

    name = "disk"

    def __init__(self, root: Path, budget: int) -> None:
        self.root, self.budget = Path(root), budget
        self.root.mkdir(parents=True, exist_ok=True)
        self._usage = _Usage()
        self._lock = threading.Lock()
        self._held: int | None = None  # bytes under root, as this process last counted them

    def _path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise MalformedFile(f"not a KV block key: {key[:80]!r}")
        return self.root / key[:2] / key

    def get(self, key: str) -> bytes | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        with self._lock:
            self._usage.touch(key)
        return data

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if self._holds(path, data):
            return  # the same name and digest, and the bytes on disk are still those
        path.parent.mkdir(exist_ok=True)  # new, or a damaged copy under the name: replaced whole
        tmp = path.with_name(f".{key}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a reader sees the block whole or not at all
        with self._lock:
            self._usage.touch(key)
            self._held = None if self._held is None else self._held + len(data)
            if self._held is None or self._held > self.budget:
                self._evict(keep=key)

    @staticmethod
    def _holds(path: Path, data: bytes) -> bool:
        """Whether ``path`` already holds exactly ``data`` (a copy damaged on disk does not: it is rewritten,
        not kept, or every later lookup would refuse it and recompute again)."""
        try:
            return path.stat().st_size == len(data) and path.read_bytes() == data
        except OSError:  # absent or unreadable: write it
            return False

    def _evict(self, keep: str) -> None:
        """Count what is on disk (other instances write here too), then remove the least used until within budget."""
        sizes: dict[str, int] = {}
        for p in self.root.glob("??/*"):
            try:
                if not p.name.startswith("."):
                    sizes[p.name] = p.stat().st_size
            except FileNotFoundError:  # another instance evicted it meanwhile
                continue
        self._held = sum(sizes.values())
        for victim in self._usage.victims(list(sizes), keep=keep):
            if self._held <= self.budget:
                return
            (self.root / victim[:2] / victim).unlink(missing_ok=True)
            self._held -= sizes[victim]
            self._usage.forget(victim)


def tier_key(name: str, content: str) -> str:
    """Where a block is kept on a tier: its name and its digest, so a write never replaces another's bytes."""
    return f"{name}-{content}"


@dataclass(frozen=True, slots=True)
class Lookup:
    data: bytes | None
    tier: str
    refused: int  # copies found that did not match the digest


class TieredBlocks:
    """Nearest tier first; only bytes that hash to the digest asked for count, and only those are copied nearer."""

    def __init__(self, tiers: Sequence[BlockStore]) -> None:
        self.tiers = list(tiers)

    def get(self, name: str, content: str) -> Lookup:
        """The block's bytes, proven against ``content``, and the tier they came from (``data`` None: no good copy)."""
        key, refused = tier_key(name, content), 0
        for i, tier in enumerate(self.tiers):
            try:
                data = tier.get(key)
            except (OSError, MalformedFile) as exc:  # an unreadable tier is a tier without the block
                log.warning("KV block %s unreadable on the %s tier: %s", key, tier.name, exc)
                continue
            if data is None:
                continue
            if digest(data) != content:
                log.warning("KV block %s on the %s tier does not match its digest: not used", key, tier.name)
                refused += 1
                continue
            self._put(self.tiers[:i], key, data)
            return Lookup(data, tier.name, refused)
        return Lookup(None, "", refused)

    def put(self, name: str, data: bytes) -> str:
        """Keep a block on every tier; returns its digest (recorded with the conversation)."""
        content = digest(data)
        self._put(self.tiers, tier_key(name, content), data)
        return content

    @staticmethod
    def _put(tiers: Sequence[BlockStore], key: str, data: bytes) -> None:
        for tier in tiers:
            try:
                tier.put(key, data)
            except OSError as exc:  # a full or failing tier: the block is recomputed if ever needed
                log.warning("KV block %s not kept on the %s tier: %s", key, tier.name, exc)
