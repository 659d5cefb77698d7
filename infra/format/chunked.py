"""The chunked checkpoint format: tensors in row-aligned chunks, each a file named by its digest.

A step directory holds::

    chunks/<xxh3-128 hex>   rows [a, b) of a tensor, raw bytes (~1 MiB; 0-d and small tensors whole)
    chunks.json             per state, per tensor: dtype, shape, [[digest, first row, end row], ...]
    state.json              the non-tensor state, exactly as the plain format stores it
    manifest.json           every file above with its size and digests, written last

Every directory is self-contained: a chunk an earlier checkpoint of the run already
holds is hard-linked into the new one (:class:`infra.format.store.Link`), so unchanged
tensors cost no bytes written, and deleting a step directory only drops links (the
filesystem's link count is the reference count). Verification, replication, retention
and catalog rebuild see ordinary files listed in a manifest. Nothing is unpickled:
tensors are rebuilt from chunk bytes that matched the manifest before they are used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from infra.errors import CorruptCheckpoint, MalformedFile
from infra.format import manifest as mf
from infra.format import tensorfile
from infra.format.digest import Hasher, hash_bytes
from infra.format.store import FileWriter, Link
from infra.format.verify import Finding, verified_read

INDEX_FILE = "chunks.json"
CHUNK_DIR = "chunks"
INDEX_FORMAT = "rewind.chunks/1"
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Chunk:
    digest: str
    data: memoryview


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t if t.device.type == "cpu" and t.is_contiguous() else t.to("cpu").contiguous()


def _rows(shape: list[int] | torch.Size) -> int:
    return int(shape[0]) if len(shape) else 1


def split_tensor(name: str, t: torch.Tensor, chunks: dict[str, Chunk]) -> dict[str, Any]:
    """Cut ``t`` into row-aligned chunks of about ``CHUNK_BYTES``; add them to ``chunks``; its index entry."""
    t = _cpu(t)
    dtype = tensorfile.dtype_name(name, t.dtype)
    view = tensorfile.byte_view(t)
    rows = _rows(t.shape)
    row_bytes = len(view) // rows if rows else 0
    per = max(1, CHUNK_BYTES // row_bytes) if row_bytes else max(rows, 1)
    refs: list[list[Any]] = []
    for a in range(0, rows if len(view) else 0, per):
        b = min(rows, a + per)
        data = view[a * row_bytes : b * row_bytes]
        h = Hasher(with_crc=False)
        h.update(data)
        digest = h.result().xxh3
        chunks.setdefault(digest, Chunk(digest, data))
        refs.append([digest, a, b])
    return {"dtype": dtype, "shape": list(t.shape), "chunks": refs}


def build_index(tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[dict[str, Any], dict[str, Chunk]]:
    """The index of every state's tensors, and the distinct chunks they are made of."""
    chunks: dict[str, Chunk] = {}
    states = {
        part: {name: split_tensor(name, t, chunks) for name, t in sorted(ts.items())}
        for part, ts in tensors.items()
    }
    return {"format": INDEX_FORMAT, "chunk_bytes": CHUNK_BYTES, "states": states}, chunks


def parent_chunks(parent: Path | None) -> dict[str, mf.FileEntry]:
    """The chunk files an earlier checkpoint directory lists (none when it is gone or unreadable)."""
    if parent is None:
        return {}
    try:
        files = mf.read(parent).files
    except (OSError, mf.ManifestError):
        return {}
    return {e.path: e for e in files if e.path.startswith(f"{CHUNK_DIR}/")}


def _bytes_writer(data: memoryview | bytes) -> FileWriter:
    def fill(out: BinaryIO) -> None:
        out.write(data)

    return fill


def file_writers(
    tensors: Mapping[str, Mapping[str, torch.Tensor]], parent: Path | None
) -> list[tuple[str, FileWriter | Link]]:
    """Chunk files (linked from ``parent`` where it lists the same digest), then the index.

    A linked file's entry is hashed here from the bytes being saved, so the new manifest
    states what the bytes are whatever the parent's copy has become since.
    """
    index, chunks = build_index(tensors)
    have = parent_chunks(parent)
    files: list[tuple[str, FileWriter | Link]] = []
    for c in chunks.values():
        name = f"{CHUNK_DIR}/{c.digest}"
        write = _bytes_writer(c.data)
        prior = have.get(name)
        if parent is not None and prior is not None and (prior.xxh3, prior.size) == (c.digest, len(c.data)):
            d = hash_bytes(c.data)
            files.append((name, Link(parent / name, mf.FileEntry(name, d.size, d.xxh3, d.crc32c), write)))
        else:
            files.append((name, write))
    raw = json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
    files.append((INDEX_FILE, _bytes_writer(raw)))
    return files


def _spec(name: str, info: Any) -> tuple[torch.dtype, list[int], list[tuple[str, int, int]]]:
    """One tensor's index entry, checked: its chunks tile its rows exactly, in order."""
    if not isinstance(info, dict) or not isinstance(info.get("chunks"), list):
        raise MalformedFile(f"tensor {name!r} has a malformed index entry")
    dtype = tensorfile.dtype_named(name, info.get("dtype"))
    shape = tensorfile.checked_shape(name, info.get("shape"))
    refs: list[tuple[str, int, int]] = []
    end = 0
    for ref in info["chunks"]:
        ok = isinstance(ref, list) and len(ref) == 3 and isinstance(ref[0], str)
        if not ok or not all(type(x) is int for x in ref[1:]) or ref[1] != end or ref[2] <= ref[1]:
            raise MalformedFile(f"tensor {name!r} has a chunk list that does not tile its rows")
        refs.append((ref[0], ref[1], ref[2]))
        end = ref[2]
    empty = any(n == 0 for n in shape)
    if end != (0 if empty else _rows(shape)):
        raise MalformedFile(f"tensor {name!r} has chunks for {end} rows of {_rows(shape)}")
    return dtype, shape, refs


def _read_chunk(
    directory: Path, entries: Mapping[str, mf.FileEntry], tensor: str, digest: str, view: memoryview
) -> None:
    """Fill ``view`` from one chunk file, proven against its manifest entry; findings name tensor and chunk."""
    name = f"{CHUNK_DIR}/{digest}"
    entry = entries.get(name)
    if entry is None or entry.size != len(view) or entry.xxh3 != digest:
        raise MalformedFile(
            f"tensor {tensor!r} needs chunk {digest} of {len(view)} bytes; the manifest lacks it"
        )
    try:
        with verified_read(directory, entry) as reader:
            reader.fill(view)
    except CorruptCheckpoint as exc:
        findings = [
            Finding(f.problem, f.path, f"tensor {tensor!r}, chunk {digest}: {f.detail}") for f in exc.findings
        ]
        raise CorruptCheckpoint(str(directory), findings) from exc


def read_tensors(directory: Path, entries: Mapping[str, mf.FileEntry], index: Any) -> dict[str, torch.Tensor]:
    """Every tensor the (verified) ``index`` names, each rebuilt in storage of its own from verified chunks.

    ``MalformedFile`` for an index that does not describe its chunks; ``CorruptCheckpoint``
    for a chunk whose bytes differ from the manifest; ``OSError`` for an I/O error.
    """
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise MalformedFile(f"{INDEX_FILE} is not a {INDEX_FORMAT} index")
    states = index.get("states")
    if not isinstance(states, dict) or not all(isinstance(ts, dict) for ts in states.values()):
        raise MalformedFile(f"{INDEX_FILE} has no tensors per state")
    out: dict[str, torch.Tensor] = {}
    for ts in states.values():
        for name, info in ts.items():
            dtype, shape, refs = _spec(str(name), info)
            t = tensorfile.allocate(str(name), shape, dtype)
            view = tensorfile.byte_view(t)
            row_bytes = len(view) // _rows(shape) if refs else 0
            for digest, a, b in refs:
                _read_chunk(directory, entries, str(name), digest, view[a * row_bytes : b * row_bytes])
            out[str(name)] = t
    return out
