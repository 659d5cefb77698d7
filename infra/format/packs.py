"""Pack files: the chunks of a chunked checkpoint, stored back to back in files of ~32 MiB.

One file per chunk cost a create and an fsync per MiB (a full save ran 1.8-2.6x slower
than the plain format); packs cost one per 32 MiB and keep a tensor's chunks adjacent,
so a restore reads nearly sequentially.

A save links a pack of the parent checkpoint when at least ``KEEP_LIVE`` of its bytes
are chunks the new checkpoint still uses (restic's rule: never rewrite stored data just
to drop a little dead space); otherwise the chunks it still uses are *carried*: written
again, into packs of their own, apart from the chunks that changed, so that a pack made
of long-unchanged chunks stays fully live and is linked for as long as they stay so.

A pack's name is the xxh3-128 of the list of chunk digests it was made with: an
identity, not a content digest (the manifest holds that). The index lists, per pack,
only the chunks this checkpoint uses, at their offsets; every one is proven against
its digest as it is read, so dead bytes in a linked pack are never read at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from rewind.infra.errors import CorruptCheckpoint, MalformedFile
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import Hasher, HashingReader, manifest_matches
from rewind.infra.format.files import NotAFile
from rewind.infra.format.store import FileWriter, Link
from rewind.infra.format.verify import Finding, Problem, not_a_file, open_for_read, read_verified

READ_STREAMS = 4  # packs read at once by a restore: hashing and reads release the GIL
PACK_DIR = "packs"
PACK_BYTES = 32 << 20
KEEP_LIVE = 0.5  # a parent pack is linked while at least this share of its bytes is still used
_ZEROS = bytes(1 << 20)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Chunk:
    digest: str
    data: memoryview
    whole: memoryview | None = None  # the bytes of the tensor it was cut from, where ``data`` lies at ``at``
    at: int = 0


@dataclass(slots=True)
class Pack:
    """One pack file of a checkpoint: its name and the chunks it uses, as (digest, offset, length)."""

    name: str
    size: int
    refs: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def path(self) -> str:
        return f"{PACK_DIR}/{self.name}"


def pack_name(digests: Iterable[str]) -> str:
    h = Hasher(with_crc=False)
    h.update("\n".join(digests).encode())
    return h.result().xxh3


def _refs(raw: Any, size: int) -> list[tuple[str, int, int]] | None:
    """A pack's chunk list from an index: in order, inside the pack, never overlapping; else None."""
    if not isinstance(raw, list):
        return None
    refs: list[tuple[str, int, int]] = []
    end = 0
    for r in raw:
        if not (isinstance(r, list) and len(r) == 3 and isinstance(r[0], str)):
            return None
        if not all(type(x) is int for x in r[1:]) or r[1] < end or r[2] <= 0 or r[1] + r[2] > size:
            return None
        refs.append((r[0], r[1], r[2]))
        end = r[1] + r[2]
    return refs


@dataclass(frozen=True, slots=True)
class Parent:
    """The checkpoint a save may link packs from, and the manifest digest the catalog recorded for it."""

    path: Path
    digest: str


MAX_INDEX_BYTES = 1 << 30  # a parent index larger than this is not read (1M chunks take ~100 MB)


def _parent_index(parent: Parent, index_file: str) -> tuple[dict[str, mf.FileEntry], Any]:
    """The parent's manifest entries and index, both proven: the manifest against the catalog's digest."""
    with open(parent.path / mf.MANIFEST_NAME, "rb") as f:
        raw = mf.read_bounded(f)
    if not manifest_matches(raw, parent.digest):
        raise ValueError("the parent's manifest is not the one the catalog recorded")
    entries = {e.path: e for e in mf.parse(raw).files}
    entry = entries[index_file]
    if entry.size > MAX_INDEX_BYTES:
        raise ValueError("the parent's index is too large to read")
    return entries, json.loads(read_verified(parent.path, entry))


def parent_packs(
    parent: Parent | None, index_file: str, index_format: str
) -> dict[str, tuple[mf.FileEntry, Pack]]:
    """The packs an earlier checkpoint lists, by name; none when it is gone, unreadable or not the catalog's.

    Only link decisions rest on this, so anything wrong with the parent means "link
    nothing" (the save writes every pack), never a failed save: a broken parent must not
    stop a job from checkpointing.
    """
    if parent is None:
        return {}
    try:
        entries, table = _parent_index(parent, index_file)
    except Exception:
        return {}
    if not isinstance(table, dict) or table.get("format") != index_format:
        return {}
    raw_packs = table.get("packs")
    out: dict[str, tuple[mf.FileEntry, Pack]] = {}
    for name, raw in raw_packs.items() if isinstance(raw_packs, dict) else ():
        entry = entries.get(f"{PACK_DIR}/{name}")
        refs = _refs(raw, entry.size) if entry is not None else None
        if entry is not None and refs:
            out[name] = (entry, Pack(name, entry.size, refs))
    return out


@dataclass(slots=True)
class Layout:
    """Where every chunk of a save goes: parent packs linked, and new packs (carried, then changed)."""

    linked: list[tuple[mf.FileEntry, Pack, Path]] = field(default_factory=list)
    new: list[tuple[Pack, list[Chunk]]] = field(default_factory=list)

    def packs(self) -> dict[str, list[list[Any]]]:
        every = [p for _e, p, _s in self.linked] + [p for p, _c in self.new]
        return {p.name: [[d, o, n] for d, o, n in p.refs] for p in every}


def _pack_of(group: list[Chunk]) -> tuple[Pack, list[Chunk]]:
    pack = Pack(pack_name(g.digest for g in group), sum(len(g.data) for g in group))
    offset = 0
    for g in group:
        pack.refs.append((g.digest, offset, len(g.data)))
        offset += len(g.data)
    return pack, group


def cut(items: list[T], size: Callable[[T], int]) -> Iterator[list[T]]:
    """``items`` in order, cut into groups of at most ``PACK_BYTES`` (a bigger item is a group of its own)."""
    group: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if group and total + n > PACK_BYTES:
            yield group
            group, total = [], 0
        group.append(item)
        total += n
    if group:
        yield group


def mostly_live(pack: Pack, used: Iterable[tuple[str, int, int]]) -> bool:
    """Whether the chunks ``used`` of ``pack`` (digest, offset, length) keep it worth linking."""
    return sum(n for _d, _o, n in used) >= KEEP_LIVE * pack.size


def _group(chunks: list[Chunk]) -> Iterator[tuple[Pack, list[Chunk]]]:
    """Chunks in order, cut into packs of at most ``PACK_BYTES`` (a bigger chunk is a pack of its own)."""
    return (_pack_of(group) for group in cut(chunks, lambda c: len(c.data)))


def layout(
    chunks: Mapping[str, Chunk], parent: Parent | None, prior: Mapping[str, tuple[mf.FileEntry, Pack]]
) -> Layout:
    """Link the parent's packs that are mostly still used; write the rest, carried chunks apart."""
    out = Layout()
    covered: set[str] = set()
    passed: list[str] = []
    for entry, pack in prior.values():
        used = [
            (d, o, n)
            for d, o, n in pack.refs
            if d in chunks and d not in covered and len(chunks[d].data) == n
        ]
        if parent is not None and used and mostly_live(pack, used):
            out.linked.append((entry, Pack(pack.name, pack.size, used), parent.path / pack.path))
            covered.update(d for d, _o, _n in used)
        else:
            passed.extend(d for d, _o, _n in used)
    was = set(passed) - covered
    carried = [c for c in chunks.values() if c.digest in was]  # in tensor order, like every pack
    changed = [c for c in chunks.values() if c.digest not in covered and c.digest not in was]
    out.new = [*_group(carried), *_group(changed)]
    return out


def pack_writer(chunks: list[Chunk]) -> FileWriter:
    def fill(out: BinaryIO) -> None:
        for run in _runs(chunks):
            out.write(run)

    return fill


def _runs(chunks: list[Chunk]) -> Iterator[memoryview]:
    """The chunks' bytes in order, those cut back to back from one tensor as one view: one large write, which
    the disk takes faster than the same bytes a 1 MiB chunk at a time."""
    i = 0
    while i < len(chunks):
        first, end, i = chunks[i], chunks[i].at + len(chunks[i].data), i + 1
        while (
            first.whole is not None
            and i < len(chunks)
            and chunks[i].whole is first.whole
            and chunks[i].at == end
        ):
            end, i = end + len(chunks[i].data), i + 1
        yield (
            first.data
            if first.whole is None or end == first.at + len(first.data)
            else first.whole[first.at : end]
        )


def _relink_writer(pack: Pack, chunks: Mapping[str, Chunk]) -> FileWriter:
    """A linked pack written anew when the link cannot be made: its used chunks at their offsets, zeros between."""

    def fill(out: BinaryIO) -> None:
        at = 0
        for d, o, _n in pack.refs:  # in order, never overlapping (``_refs``)
            at = _zeros(out, at, o)
            at += out.write(chunks[d].data)
        _zeros(out, at, pack.size)

    return fill


def _zeros(out: BinaryIO, at: int, end: int) -> int:
    while at < end:
        at += out.write(_ZEROS[: min(len(_ZEROS), end - at)])
    return at


def file_writers(plan: Layout, chunks: Mapping[str, Chunk]) -> list[tuple[str, FileWriter | Link]]:
    """Linked packs first (the entry is the parent's: the chunks used are proven by the index), then new ones."""
    files: list[tuple[str, FileWriter | Link]] = []
    for entry, pack, source in plan.linked:
        files.append(
            (
                pack.path,
                Link(
                    source,
                    mf.FileEntry(pack.path, entry.size, entry.xxh3, entry.crc32c),
                    _relink_writer(pack, chunks),
                ),
            )
        )
    files.extend((pack.path, pack_writer(group)) for pack, group in plan.new)
    return files


def chunk_table(raw: Any, entries: Mapping[str, mf.FileEntry]) -> dict[str, tuple[mf.FileEntry, int, int]]:
    """Where each chunk lies, from a (verified) index's pack lists: digest -> (pack entry, offset, length)."""
    if not isinstance(raw, dict):
        raise MalformedFile("the index lists no packs")
    table: dict[str, tuple[mf.FileEntry, int, int]] = {}
    for name, listed in raw.items():
        entry = entries.get(f"{PACK_DIR}/{name}")
        if entry is None:
            raise MalformedFile(f"pack {name} is not in the manifest")
        refs = _refs(listed, entry.size)
        if refs is None:
            raise MalformedFile(f"pack {name} has a malformed chunk list")
        for d, o, n in refs:
            table.setdefault(d, (entry, o, n))
    return table


@dataclass(frozen=True, slots=True)
class Want:
    """A chunk a tensor needs from a pack: where it lies, what it must hash to, where its bytes go."""

    offset: int
    digest: str
    tensor: str
    view: memoryview


def _damaged(directory: Path, entry: mf.FileEntry, problem: Problem, w: Want, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        str(directory), [Finding(problem, entry.path, f"tensor {w.tensor!r}, chunk {w.digest}: {why}")]
    )


def _fill(f: BinaryIO, directory: Path, entry: mf.FileEntry, w: Want) -> None:
    """Read one chunk into its view and prove it against its digest before anything else is read."""
    f.seek(w.offset)
    reader = HashingReader(f, Hasher(with_crc=False))
    if not reader.fill(w.view):
        raise _damaged(directory, entry, Problem.SIZE, w, f"the pack ends at byte {w.offset + reader.count}")
    got = reader.hasher.result().xxh3
    if got != w.digest:
        raise _damaged(directory, entry, Problem.DIGEST, w, f"the bytes at offset {w.offset} hash to {got}")


def read_pack(directory: Path, entry: mf.FileEntry, wants: list[Want]) -> None:
    """Fill every view ``wants`` names from one pack, in offset order; a chunk used twice is read once."""
    try:
        with open_for_read(directory, entry.path) as f:
            done: dict[tuple[int, str], memoryview] = {}
            for w in sorted(wants, key=lambda w: w.offset):
                same = done.get((w.offset, w.digest))
                if same is not None:
                    w.view[:] = same
                    continue
                _fill(f, directory, entry, w)
                done[(w.offset, w.digest)] = w.view
    except FileNotFoundError as exc:
        finding = Finding(Problem.MISSING, entry.path, "listed in the manifest but not on disk")
        raise CorruptCheckpoint(str(directory), [finding]) from exc
    except NotAFile as exc:
        raise CorruptCheckpoint(str(directory), [not_a_file(entry, exc)]) from exc


def read_packs(directory: Path, wants: list[tuple[mf.FileEntry, list[Want]]]) -> None:
    """Read several packs at once; the first failure (in pack order) is raised once all reads stopped."""
    if len(wants) < 2:
        for entry, ws in wants:
            read_pack(directory, entry, ws)
        return
    with ThreadPoolExecutor(min(READ_STREAMS, len(wants)), thread_name_prefix="rewind-read") as pool:
        futures = [pool.submit(read_pack, directory, entry, ws) for entry, ws in wants]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
