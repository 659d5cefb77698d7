"""The chunked format for multi-rank (DCP) checkpoints: each rank's write items in packs, unchanged ones linked.

DCP plans what every rank writes (write items: a shard of a tensor, or a value's bytes) and records,
per item, the file, offset and length it lies at (``.metadata``). ``PackedWriter`` keeps DCP's planning
and metadata but stores the items the way :mod:`rewind.infra.format.packs` stores chunks: an item whose
content is what it was at the parent checkpoint stays in the parent's pack, hard-linked into the new
directory while at least ``packs.KEEP_LIVE`` of that pack is still used (and its bytes proved to be the
parent manifest's, :func:`rewind.infra.format.store.link_proven`); every other item is written, in DCP's
own encoding (``torch.save`` of the tensor, the raw bytes of a value), into new packs of about
``packs.PACK_BYTES`` named ``packs/r<rank>-<id>``. A frozen backbone is linked; what training changed is
written. Each rank lists its packs and their items' keys in ``packs-<rank>.json``; the next save's link
decisions rest on that list, read only from a parent whose manifest is the one the catalog recorded.

A key names an item's content (xxh3-128 of a plain tensor's dtype, shape, strides and bytes; of the
encoding of anything more, a quantized tensor's scales or a subclass): it decides links, it proves
nothing. Reading needs no reader of its own: :class:`rewind.infra.format.dcp.VerifiedReader` reads a
pack like any file the manifest lists, whole, proven against its digest before DCP sees a byte of it.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from rewind.infra.format import manifest as mf
from rewind.infra.format import packs, store, tensorfile
from rewind.infra.format.digest import Hasher
from rewind.infra.format.packs import PACK_DIR, Parent

FORMAT = "rewind.dcp-packs/1"


def index_file(rank: int) -> str:
    """The file that lists a rank's packs and the keys of the items in them."""
    return f"packs-{rank}.json"


@dataclass(frozen=True, slots=True)
class _Item:
    """One write item, resolved: its content key, its size, and its bytes when they are held (a value's, or
    the encoding of a tensor keyed by it); a plain tensor is resolved again when it is written, so that a
    GPU tensor's host copy is not held from hashing to writing."""

    write: WriteItem
    key: str
    size: int
    raw: memoryview | None = None


def item_tensor(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    """The tensor DCP's own writer would save for ``item`` (on the CPU, in storage of its own size)."""
    t = planner.resolve_data(item)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"DCP resolved {item.index.fqn} to a {type(t).__name__}, not a tensor")
    t = t.detach().cpu()
    return t.clone() if t.untyped_storage().size() != t.nbytes else t


def _plain(t: torch.Tensor) -> bool:
    """Whether dtype, shape, strides and element bytes are all ``t`` is: not a subclass, quantized (scales),
    sparse, or a view with the conjugate or negative bit."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
    )


def _saved(t: torch.Tensor) -> memoryview:
    """DCP's encoding of a tensor: ``torch.save``."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getbuffer()


def _resolve(planner: SavePlanner, item: WriteItem) -> _Item:
    h = Hasher(with_crc=False)
    if item.type == WriteItemType.BYTE_IO:
        value = planner.resolve_data(item)
        if not isinstance(value, io.BytesIO):
            raise TypeError(f"DCP resolved {item.index.fqn} to a {type(value).__name__}, not bytes")
        raw = value.getbuffer()
        h.update(b"bytes\0")
        h.update(raw)
        return _Item(item, h.result().xxh3, len(raw), raw)
    t = item_tensor(planner, item)
    if not _plain(t):  # keyed by its encoding, which holds all it is
        raw = _saved(t)
        h.update(b"saved\0")
        h.update(raw)
        return _Item(item, h.result().xxh3, len(raw), raw)
    h.update(json.dumps(["tensor", str(t.dtype), list(t.shape), list(t.stride())]).encode())
    h.update(tensorfile.byte_view(t.contiguous()))
    return _Item(item, h.result().xxh3, t.nbytes)


def _size(item: _Item) -> int:
    return item.size


def _encode(planner: SavePlanner, item: _Item) -> memoryview:
    """The bytes DCP's reader expects for ``item``: ``torch.save`` of a tensor, a value's bytes as they are."""
    return item.raw if item.raw is not None else _saved(item_tensor(planner, item.write))


@dataclass
class _Written:
    """What a rank's packs came to: manifest entries, the index, each item's place."""

    entries: list[mf.FileEntry] = field(default_factory=list)
    packs: dict[str, list[list[Any]]] = field(default_factory=dict)
    # each item's key -> (pack path, offset, length)
    places: dict[str, tuple[str, int, int]] = field(default_factory=dict)


class PackedWriter(dcp.FileSystemWriter):
    """DCP's file system writer, its items stored in packs; ``parent``: where unchanged items may be linked
    from (the parent checkpoint on this rank's disk, held to the catalog's digest of its manifest)."""

    def __init__(self, path: Path, *, rank: int, parent: Parent | None) -> None:
        super().__init__(str(path), sync_files=True)
        self._dir, self._rank, self._parent = Path(path), rank, parent
        self.written = _Written()

    def index_bytes(self) -> bytes:
        index = {"format": FORMAT, "packs": self.written.packs}
        return json.dumps(index, sort_keys=True, separators=(",", ":")).encode()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items = [_resolve(planner, w) for w in plan.items]
        unique = {i.key: i for i in items}  # the same content twice is stored once
        (self._dir / PACK_DIR).mkdir(exist_ok=True)
        left, was = self._link(unique)
        carried = [i for i in left if i.key in was]  # apart from the changed ones, as packs.layout does
        changed = [i for i in left if i.key not in was]
        for group in (*packs.cut(carried, _size), *packs.cut(changed, _size)):
            self._write_pack(planner, group)
        store.fsync_dir(self._dir / PACK_DIR)
        results = []
        for i in items:
            path, offset, length = self.written.places[i.key]
            info = _StorageInfo(path, offset, length)
            results.append(WriteResult(index=i.write.index, size_in_bytes=length, storage_data=info))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _link(self, unique: dict[str, _Item]) -> tuple[list[_Item], set[str]]:
        """Link the parent's packs of this rank still mostly used: the items left to write (in plan order),
        and the keys of those the parent held (carried: written apart from the changed ones)."""
        mine = f"r{self._rank}-"
        prior = packs.parent_packs(self._parent, index_file(self._rank), FORMAT)
        was: set[str] = set()
        for name, (entry, pack) in prior.items():
            used = [(k, o, n) for k, o, n in pack.refs if k in unique and k not in self.written.places]
            was.update(k for k, _o, _n in used)
            if not name.startswith(mine) or not used or not packs.mostly_live(pack, used):
                continue
            assert self._parent is not None
            if not store.link_proven(self._dir / pack.path, self._parent.path / pack.path, entry):
                continue  # the parent's bytes are gone or not its manifest's: written again instead
            self.written.entries.append(replace(entry, path=pack.path))
            self.written.packs[name] = [[k, o, n] for k, o, n in used]
            self.written.places.update((k, (pack.path, o, n)) for k, o, n in used)
        return [i for i in unique.values() if i.key not in self.written.places], was

    def _write_pack(self, planner: SavePlanner, group: list[_Item]) -> None:
        name = f"r{self._rank}-{packs.pack_name(i.key for i in group)}"
        path = f"{PACK_DIR}/{name}"
        refs: list[list[Any]] = []

        def fill(out: BinaryIO) -> None:
            offset = 0
            for i in group:
                n = out.write(_encode(planner, i))
                refs.append([i.key, offset, n])
                offset += n

        entry = store.write_file(self._dir / path, fill)
        self.written.entries.append(replace(entry, path=path))
        self.written.packs[name] = refs
        self.written.places.update((k, (path, o, n)) for k, o, n in refs)
