"""The chunked checkpoint format: tensors in row-aligned chunks named by digest, stored in packs.

A step directory holds::

    packs/<name>    chunks back to back, ~32 MiB a pack (:mod:`rewind.infra.format.packs`)
    chunks.json     per state, per tensor: dtype, shape, [[digest, first row, end row], ...];
                    per pack: [[digest, offset, length], ...] of the chunks this checkpoint uses
    state.json      the non-tensor state, exactly as the plain format stores it
    manifest.json   every file above with its size and digests, written last

Every directory is self-contained: a pack of the previous checkpoint whose chunks are
mostly still in use is hard-linked into the new one (:class:`rewind.infra.format.store.Link`),
so unchanged tensors cost no bytes written, and deleting a step directory only drops
links (the filesystem's link count is the reference count). Verification, replication,
retention and catalog rebuild see ordinary files listed in a manifest. Nothing is
unpickled: tensors are rebuilt from chunk bytes, each proven against its digest in the
(verified) index before it is used. Directories of the first version of the format
(``rewind.chunks/1``: one file per chunk under ``chunks/``) are still read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rewind.infra.errors import CorruptCheckpoint, MalformedFile
from rewind.infra.format import manifest as mf
from rewind.infra.format import packs, tensorfile
from rewind.infra.format.digest import Hasher
from rewind.infra.format.packs import Chunk, Parent
from rewind.infra.format.store import FileWriter, Link, bytes_writer
from rewind.infra.format.verify import Finding, verified_read

INDEX_FILE = "chunks.json"
INDEX_FORMAT = "rewind.chunks/2"
LEGACY_FORMAT = "rewind.chunks/1"  # one file per chunk, under LEGACY_CHUNK_DIR: read, never written
LEGACY_CHUNK_DIR = "chunks"
CHUNK_BYTES = 1 << 20


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t if t.device.type == "cpu" and t.is_contiguous() else t.to("cpu").contiguous()


def _rows(shape: list[int] | torch.Size) -> int:
    return int(shape[0]) if len(shape) else 1


ChunkKey = tuple[str, str, int]  # (state, tensor, first row): a chunk's place in a save


def grid(shape: list[int] | torch.Size, nbytes: int) -> tuple[int, list[tuple[int, int]]]:
    """A tensor's bytes per row and its chunks' row ranges: row-aligned, about ``CHUNK_BYTES`` each."""
    rows = _rows(shape)
    row_bytes = nbytes // rows if rows else 0
    per = max(1, CHUNK_BYTES // row_bytes) if row_bytes else max(rows, 1)
    return row_bytes, [(a, min(rows, a + per)) for a in range(0, rows if nbytes else 0, per)]


def ordered(tensors: Mapping[str, Mapping[str, torch.Tensor]]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Every (state, tensor name, tensor) in the order a save lays out its chunks."""
    for part, ts in tensors.items():
        for name, t in sorted(ts.items()):
            yield part, name, t


def split_tensor(
    name: str,
    t: torch.Tensor,
    chunks: dict[str, Chunk],
    *,
    part: str = "",
    known: Mapping[ChunkKey, str] | None = None,
) -> dict[str, Any]:
    """Cut ``t`` into row-aligned chunks of about ``CHUNK_BYTES``; add them to ``chunks``; its index entry.

    ``known``: digests of these very bytes computed already (``stage_chunked``), by (``part``, ``name``,
    first row); any chunk it lacks is hashed here."""
    t = _cpu(t)
    dtype = tensorfile.dtype_name(name, t.dtype)
    view = tensorfile.byte_view(t)
    row_bytes, ranges = grid(t.shape, len(view))
    refs: list[list[Any]] = []
    for a, b in ranges:
        data = view[a * row_bytes : b * row_bytes]
        digest = known.get((part, name, a)) if known else None
        if digest is None:
            h = Hasher(with_crc=False)
            h.update(data)
            digest = h.result().xxh3
        chunks.setdefault(digest, Chunk(digest, data, view, a * row_bytes))
        refs.append([digest, a, b])
    return {"dtype": dtype, "shape": list(t.shape), "chunks": refs}


def build_index(
    tensors: Mapping[str, Mapping[str, torch.Tensor]], known: Mapping[ChunkKey, str] | None = None
) -> tuple[dict[str, Any], dict[str, Chunk]]:
    """The index of every state's tensors, and the distinct chunks they are made of, in tensor order."""
    chunks: dict[str, Chunk] = {}
    states: dict[str, dict[str, Any]] = {part: {} for part in tensors}
    for part, name, t in ordered(tensors):
        states[part][name] = split_tensor(name, t, chunks, part=part, known=known)
    index = {
        "format": INDEX_FORMAT,
        "chunk_bytes": CHUNK_BYTES,
        "pack_bytes": packs.PACK_BYTES,
        "states": states,
    }
    return index, chunks


def file_writers(
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    parent: Parent | None,
    known: Mapping[ChunkKey, str] | None = None,
) -> list[tuple[str, FileWriter | Link]]:
    """Packs (those of ``parent`` still mostly used are linked, the rest written), then the index."""
    index, chunks = build_index(tensors, known)
    plan = packs.layout(chunks, parent, packs.parent_packs(parent, INDEX_FILE, INDEX_FORMAT))
    index["packs"] = plan.packs()
    files = packs.file_writers(plan, chunks)
    raw = json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
    files.append((INDEX_FILE, bytes_writer(raw)))
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


def _read_legacy_chunk(
    directory: Path, entries: Mapping[str, mf.FileEntry], tensor: str, digest: str, view: memoryview
) -> None:
    """Fill ``view`` from one ``rewind.chunks/1`` chunk file, proven against its manifest entry."""
    name = f"{LEGACY_CHUNK_DIR}/{digest}"
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


Pieces = list[tuple[str, str, memoryview]]  # (tensor, chunk digest, where its bytes go)


def _allocate(states: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Pieces]:
    """Every tensor the index names, allocated, and the chunk each row range of it needs."""
    out: dict[str, torch.Tensor] = {}
    pieces: Pieces = []
    for ts in states.values():
        for name, info in ts.items():
            if str(name) in out:  # two states naming one tensor (saved before a save refused it)
                raise MalformedFile(f"tensor {str(name)[:200]!r} is in two states of the index")
            dtype, shape, refs = _spec(str(name), info)
            t = tensorfile.allocate(str(name), shape, dtype)
            view = tensorfile.byte_view(t)
            row_bytes = len(view) // _rows(shape) if refs else 0
            pieces.extend((str(name), d, view[a * row_bytes : b * row_bytes]) for d, a, b in refs)
            out[str(name)] = t
    return out, pieces


def _read_packed(
    directory: Path, entries: Mapping[str, mf.FileEntry], index: dict[str, Any], pieces: Pieces
) -> None:
    """Fill every piece from the packs, pack by pack, each chunk proven as it is read."""
    table = packs.chunk_table(index.get("packs"), entries)
    wants: dict[str, tuple[mf.FileEntry, list[packs.Want]]] = {}
    for tensor, digest, view in pieces:
        if digest not in table:
            raise MalformedFile(f"tensor {tensor!r} needs chunk {digest}, which no pack lists")
        entry, offset, length = table[digest]
        if length != len(view):
            raise MalformedFile(
                f"tensor {tensor!r} needs {len(view)} bytes of chunk {digest}, its pack holds {length}"
            )
        wants.setdefault(entry.path, (entry, []))[1].append(packs.Want(offset, digest, tensor, view))
    packs.read_packs(directory, list(wants.values()))


def read_tensors(directory: Path, entries: Mapping[str, mf.FileEntry], index: Any) -> dict[str, torch.Tensor]:
    """Every tensor the (verified) ``index`` names, each rebuilt in storage of its own from verified chunks.

    ``MalformedFile`` for an index that does not describe its chunks; ``CorruptCheckpoint``
    for a chunk whose bytes differ from its digest; ``OSError`` for an I/O error.
    """
    fmt = index.get("format") if isinstance(index, dict) else None
    if fmt not in (INDEX_FORMAT, LEGACY_FORMAT):
        raise MalformedFile(f"{INDEX_FILE} is not a {INDEX_FORMAT} index")
    states = index.get("states")
    if not isinstance(states, dict) or not all(isinstance(ts, dict) for ts in states.values()):
        raise MalformedFile(f"{INDEX_FILE} has no tensors per state")
    out, pieces = _allocate(states)
    if fmt == INDEX_FORMAT:
        _read_packed(directory, entries, index, pieces)
    else:
        for tensor, digest, view in pieces:
            _read_legacy_chunk(directory, entries, tensor, digest, view)
    return out
