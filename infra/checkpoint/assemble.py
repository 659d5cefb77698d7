"""Before a spread checkpoint loads: every disk's copy completed from the others', over the process group.

Each disk's leader says which of the manifest's files its copy holds (present, of the manifest's size;
their bytes are hashed as DCP reads them). A file some disk lacks is sent by the lowest rank holding it
as a byte tensor, and every rank lacking it keeps it only once its bytes hash to the manifest's entry
(nothing received is unpickled). A disk with no copy yet (a spare host) gets a whole one, manifest
last; a copy of another checkpoint at the step (a timeline replayed while the host was away), or one left
with its manifest alone (not rank 0's, which its plan proved), is moved aside first and rank 0 told, so
that the catalog's rows follow it. A disk whose copy of this checkpoint was moved aside by a save of the step
again that never told it its outcome (rank 0 killed before every disk heard) has it put back first (its rows
following). A file on no disk at hand (its host is gone) is fetched by rank 0 from another tier's copy of the
checkpoint (``Remote``: the shared tier's, nearest first), held to its entry, and sent on from there:
each file comes from the nearest place that has it: this disk, this node's memory (a ring copy of a peer's
share, ``ring_held``, hashed as it is taken), a peer's disk, another tier. When a file is on no disk, in
no memory and no other tier gives it, no disk is completed: ``ShareOnly`` on every rank, and the restore
tries the next copy. Every rank learns which files its node's memory holds (``Completed.nearer``): the load
reads those from memory first (this host's own share, where its leader kept it, included), proven as read.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rewind.infra.checkpoint import ring_held
from rewind.infra.checkpoint.spread import Disks, Moved
from rewind.infra.format import manifest as mf
from rewind.infra.format import store
from rewind.infra.format.digest import hash_bytes
from rewind.infra.format.local_tier import LocalTier
from rewind.infra.restore.execute import ShareOnly

log = logging.getLogger("rewind.assemble")
Remote = Callable[[mf.FileEntry], bytes]  # rank 0: one file's bytes from another tier's copy, proven


@dataclass(frozen=True, slots=True)
class Sources:
    """Where one disk's copy got the checkpoint's bytes: already on the disk, taken from this node's memory
    (a peer's share the ring left there), sent by another rank, or fetched from another tier."""

    host: str
    local_bytes: int
    peer_bytes: int
    remote_bytes: int = 0
    memory_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "local": self.local_bytes,
            "memory": self.memory_bytes,
            "peer": self.peer_bytes,
            "remote": self.remote_bytes,
        }


def read_from(
    sources: list[Sources], total: int, tier: str, fetched: bool, remote_tier: str = "shared"
) -> dict[str, Any]:
    """Where a restore's bytes came from, for the record (bytes per place: ``local`` on the disk that loads
    them, ``memory`` taken from the node's memory tier, ``peer`` sent by another host's ranks, or the tier
    a copy was fetched from), and per host.
    ``tier``/``fetched``: the copy the restore plan used (a whole copy fetched from that tier, or not);
    ``remote_tier``: the tier single lost files were fetched from."""
    if not sources:  # one disk for every rank: the copy the plan used
        return {"bytes": {tier: total}, "hosts": []}  # the copy's own tier, or the one it was fetched from
    hosts = [s.as_dict() for s in sources]
    if fetched:  # rank 0's disk got the whole copy from the tier before it served the others
        first = hosts[0]
        hosts[0] = {**first, "local": 0, "remote": first["remote"] + first["local"]}
    remote_tier = tier if fetched else remote_tier
    totals = {k: sum(h[k] for h in hosts) for k in ("local", "memory", "peer")}
    totals[remote_tier] = totals.get(remote_tier, 0) + sum(h["remote"] for h in hosts)
    return {"bytes": totals, "hosts": hosts}


def _held(directory: Path, manifest: mf.Manifest) -> set[str]:
    """The manifest's files this copy holds as regular files of the right size (an empty set: no copy)."""
    if not (directory / mf.MANIFEST_NAME).is_file():
        return set()
    held = set()
    for e in manifest.files:
        try:
            st = (directory / e.path).lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size == e.size:
            held.add(e.path)
    return held


def _same_checkpoint(directory: Path, raw: bytes) -> bool:
    try:
        return (directory / mf.MANIFEST_NAME).read_bytes() == raw
    except OSError:
        return False


def _receive(target: Path, entry: mf.FileEntry, data: torch.Tensor) -> None:
    """Keep a file sent by another rank, once its bytes are the manifest's."""
    raw = data.numpy().tobytes()
    got = hash_bytes(raw)
    if (got.size, got.xxh3) != (entry.size, entry.xxh3):
        raise OSError(f"{entry.path} as sent by another rank differs from the manifest's entry")
    _keep(target, entry, raw)


def _keep(target: Path, entry: mf.FileEntry, raw: bytes) -> None:
    """Write a file whose bytes were held to its entry into ``target`` (written aside, then renamed)."""
    path = target / mf.safe_relative(entry.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    store.replace_file(path, store.bytes_writer(raw))


def _exchange(
    target: Path, manifest: mf.Manifest, have: dict[int, set[str]], errors: list[str], group: Any = None
) -> int:
    """Collective: each file some rank lacks, sent from the lowest rank holding it to every rank; the bytes
    this rank received. What failed is added to ``errors`` (a rank with errors keeps nothing more)."""
    rank, got = dist.get_rank(), 0
    for e in manifest.files:
        lacking = [r for r, h in have.items() if e.path not in h]
        if not lacking:
            continue
        src = min(r for r, h in have.items() if e.path in h)
        data, error = _send(target / e.path if rank == src else None, e, src, group)
        errors += [error] if error else []
        if rank in lacking and not errors:
            try:
                _receive(target, e, data)
                got += e.size
            except Exception as exc:  # every rank must reach the next collective, whatever failed here
                errors.append(f"{type(exc).__name__}: {exc}")
    return got


def _send(
    path: Path | None, entry: mf.FileEntry, src: int, group: Any = None
) -> tuple[torch.Tensor, str | None]:
    """Collective over ``group`` (one whose backend carries CPU tensors: NCCL's does not): the bytes of one
    file from rank ``src`` to every rank; the sender's failure to read it (it then sends zeros, which no
    receiver keeps), else None."""
    data, error = torch.zeros(entry.size, dtype=torch.uint8), None
    if path is not None:
        try:
            raw = path.read_bytes()
            if len(raw) != entry.size:
                raise OSError(f"{path} is {len(raw)} bytes, the manifest says {entry.size}")
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        except OSError as exc:
            error = f"{path}: {exc.strerror or exc}"
    dist.broadcast(data, src=src, group=group)
    return data, error


Refused = Callable[[str, tuple[str, ...]], None]
# rank 0: copies of another checkpoint moved aside from where disks complete this one (their rows follow them)
Displaced = Callable[[Sequence[tuple[Moved, LocalTier]]], None]


@dataclass(frozen=True, slots=True)
class Completed:
    """This rank's disk's copy, completed (the directory to load from); each disk's sources (rank 0 only);
    the files this node's memory holds (path -> the ring copy holding it; proven where they are read): read
    before the disk's."""

    directory: Path
    sources: list[Sources]
    nearer: dict[str, Path]
    tier_id: str = ""  # the memory tier ``nearer`` is on


def complete(
    directory: Path,
    raw: bytes,
    manifest: mf.Manifest,
    disks: Disks,
    remote: Remote | None = None,
    *,
    refused: Refused | None = None,
    displaced: Displaced | None = None,
    put_back: Displaced | None = None,
    group: Any = None,
) -> Completed:
    """Collective: this rank's disk's copy of the checkpoint whose manifest bytes are ``raw``, completed
    (each disk's sources, by leader, on rank 0 only; the files this node's memory holds, on every rank).

    ``directory``: this rank's copy (rank 0: the one its restore plan chose; the others: their root's).
    ``remote`` (rank 0): fetches a file no disk at hand holds. ``refused`` (rank 0): told of each memory tier's
    ring copies refused (memory tier id, their directories), before anything else can fail; ``displaced``
    (rank 0): of each disk's copy of another checkpoint moved aside from ``directory``; ``put_back`` (rank 0):
    of each disk's copy of this checkpoint moved back there from aside, after those. ``group``: where the
    files' bytes travel (a gloo group of every rank: NCCL carries no CPU tensors; None: the default group). A file sent that is not the manifest's (or
    not readable by its sender) fails the restore on every rank, judging no copy: ``OSError``."""
    rank = dist.get_rank()
    ready = _ready(directory, raw, manifest, rank) if disks.leads(rank) else _Ready(directory)
    leads = disks.leads(rank) and ready.error is None
    held, target, fresh = ready.held, ready.target, ready.target != directory
    # a file this node's memory holds is taken before the others hear what this disk has
    memory = ring_held.held(raw, manifest) if leads else ring_held.Found()
    own_disk = disks.of_rank[rank].id
    taken, bad, dropped = (
        _take(target, manifest, memory, held or set(), own_disk) if leads else ({}, (), set())
    )
    every: list[Any] = [None] * dist.get_world_size()
    near = {p: str(d) for p, d in memory.files.items() if str(d) not in bad and p not in dropped}
    dist.all_gather_object(
        every,
        (None if held is None else (held | set(taken)), memory.tier_id, bad, near, ready.moved, ready.error,
         ready.back),
    )  # fmt: skip
    _tell(every, disks, refused, displaced, put_back)
    unready = [x[5] for x in every if x[5]]
    if unready:  # every rank fails together, none left waiting in a collective
        if fresh:
            shutil.rmtree(target, ignore_errors=True)
        raise OSError(f"a disk's copy could not be readied: {'; '.join(unready[:3])}")
    # one listing per host: its leader's
    nearer = {p: Path(d) for p, d in every[disks.leader(rank)][3].items()}
    have = {r: h for r, (h, *_) in enumerate(every) if h is not None}
    from_memory = sum(taken.values())
    errors: list[str] = []
    lost = [e for e in manifest.files if not any(e.path in h for h in have.values())]
    fetched = _fetch_lost(target, lost, remote if rank == 0 else None, fresh, manifest.step)
    have[0] = have[0] | {e.path for e in lost}
    got = _exchange(target, manifest, have, errors, group)
    _agree(errors, target if fresh else None)
    if fresh:  # a disk without a copy: now a whole one
        store.commit(target, manifest, raw)
    local = sum(e.size for e in manifest.files if e.path in (held or ()))
    report: list[Any] = [None] * dist.get_world_size()
    mine = Sources(disks.of_rank[rank].host, local, got, fetched, from_memory) if leads else None
    dist.all_gather_object(report, mine)
    sources = [s for s in report if s is not None] if rank == 0 else []
    return Completed(directory, sources, nearer, every[disks.leader(rank)][1])


@dataclass(frozen=True, slots=True)
class _Ready:
    """A disk's leader ready to complete its copy: what it moved aside, the files it holds (None: not a
    leader), where the copy is made (a fresh temporary directory, or the copy itself), this checkpoint's copy
    it put back from aside; or why not."""

    target: Path
    held: set[str] | None = None
    moved: Moved | None = None
    error: str | None = None
    back: Moved | None = None


def _ready(directory: Path, raw: bytes, manifest: mf.Manifest, rank: int) -> _Ready:
    """A leader's copy readied: another checkpoint's under the same step moved aside, and (a disk other than
    rank 0's, whose copy its plan proved) one left with its manifest alone, to be made again; then, where no
    copy of this checkpoint is left there, its copy put back from aside. Never raises: an error is told to
    every rank."""
    moved = back = None
    try:
        other = directory.exists() and not _same_checkpoint(directory, raw)
        held = set() if other else _held(directory, manifest)
        if other or (not held and directory.exists() and rank != 0):
            moved = Moved(str(directory), str(store.quarantine(directory, "displaced")))
        if not held and (back := _put_back(directory, raw, manifest, moved)) is not None:
            held = _held(directory, manifest)
        target = store.temp_dir(directory.parent, manifest.step) if not held else directory
        return _Ready(target, held, moved, back=back)
    except OSError as exc:
        return _Ready(directory, None, moved, f"rank {rank}: {type(exc).__name__}: {exc}", back)


PUT_BACK = (
    "superseded"  # why a copy lies aside that may be put back: a save of its step again (retention keeps it)
)


def _put_back(directory: Path, raw: bytes, manifest: mf.Manifest, just: Moved | None) -> Moved | None:
    """This checkpoint's copy (manifest bytes ``raw``) moved back to ``directory`` from aside, where nothing
    lies there: a save of the step again moved it aside and was cut short before this disk heard it failed
    (``spread.undo`` never ran). Only a copy holding some of its files, never the one just moved aside
    (``just``); its files are proven as they are read, like the copy's own."""
    if directory.exists():
        return None
    aside = directory.parent / store.QUARANTINE
    for candidate in sorted(aside.glob(f"{directory.name}-{PUT_BACK}-*")):
        if just is not None and str(candidate) == just.new:
            continue
        if _same_checkpoint(candidate, raw) and _held(candidate, manifest):
            candidate.rename(directory)
            with contextlib.suppress(OSError):  # renamed: rank 0 must hear of it all the same
                store.fsync_dir(directory.parent)
            log.info("%s put back from %s: a save of the step again did not commit", directory, candidate)
            return Moved(str(candidate), str(directory))
    return None


def _tell(
    every: list[Any],
    disks: Disks,
    refused: Refused | None,
    displaced: Displaced | None,
    put_back: Displaced | None,
) -> None:
    """Rank 0 told what every disk's leader did readying its copy: ring copies refused, copies of other
    checkpoints moved aside, then this checkpoint's copies put back (each record's failure logged)."""
    _tell_refused(every, refused)
    _tell_displaced([(x[4], disks.of_rank[r]) for r, x in enumerate(every) if x[4]], displaced)
    _tell_displaced([(x[6], disks.of_rank[r]) for r, x in enumerate(every) if x[6]], put_back)


def _tell_displaced(moved: list[tuple[Moved, LocalTier]], displaced: Displaced | None) -> None:
    if moved and displaced is not None:
        try:
            displaced(moved)
        except Exception as exc:  # the restore goes on: those rows name the path this copy now takes
            log.warning("copies moved aside not recorded: %s", exc)


def _tell_refused(every: list[Any], refused: Refused | None) -> None:
    if refused is None:
        return
    for _, tier_id, copies, *_ in every:
        if copies:
            try:
                refused(tier_id, copies)
            except Exception as exc:  # the restore goes on: the copies are gone, the rows say so later
                log.warning("ring copies refused in memory tier %s not recorded: %s", tier_id, exc)


def _take(
    target: Path, manifest: mf.Manifest, memory: ring_held.Found, held: set[str], disk: str
) -> tuple[dict[str, int], tuple[str, ...], set[str]]:
    """The files this disk (``disk``) lacks that this node's memory holds, copied in, each proven on the way:
    (path -> bytes taken, the ring copies refused, files of this host's own dropped). A file of the peer's
    share that does not prove (or is of another size) refuses its copy: removed, no more taken from it; one of
    this host's own is dropped alone (``ring_held.failed``). A file not taken is left to the others (a
    peer's disk, another tier), never offered."""
    taken: dict[str, int] = {}
    refused: list[str] = []
    dropped: set[str] = set()

    def failed(copy: Path, path: str) -> None:
        gone = ring_held.failed(copy, path, manifest, disk)
        refused.extend([gone] if gone else [])
        dropped.add(path)

    for path, odd in memory.wrong.items():
        failed(odd, path)
    for e in manifest.files:
        copy = memory.files.get(e.path)
        if copy is None or e.path in held or str(copy) in refused:
            continue
        try:
            raw = (copy / mf.safe_relative(e.path)).read_bytes()
            got = hash_bytes(raw)
            if (got.size, got.xxh3) != (e.size, e.xxh3):
                failed(copy, e.path)
                continue
            _keep(target, e, raw)
            taken[e.path] = e.size
        except Exception as exc:  # never raised alone: the others are about to gather
            log.warning("%s not taken from this node's memory: %s", e.path, exc)
    return taken, tuple(refused), dropped


def _fetch_lost(target: Path, lost: list[mf.FileEntry], remote: Remote | None, fresh: bool, step: int) -> int:
    """Collective: the files on no disk at hand, fetched by rank 0 (``remote``) into its disk's copy; the
    bytes fetched. ``ShareOnly`` on every rank when rank 0 cannot fetch them all."""
    if not lost:
        return 0
    why, fetched = "", 0
    if dist.get_rank() == 0:
        try:
            if remote is None:
                raise OSError("no other tier holds a copy")
            for e in lost:
                _keep(target, e, remote(e))
                fetched += e.size
        except Exception as exc:  # every rank must learn it
            why = str(exc) or type(exc).__name__
    box: list[Any] = [why]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        if fresh:
            shutil.rmtree(target, ignore_errors=True)
        names = ", ".join(e.path for e in lost[:3])
        raise ShareOnly(f"step {step}: {len(lost)} file(s) are on no disk at hand ({names}): {box[0]}")
    return fetched


def _agree(errors: list[str], fresh: Path | None) -> None:
    """Collective: every rank fails if any rank's sending or keeping failed (a half-made copy removed)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, errors)
    failed = [e for es in every for e in es]
    if failed:
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
        raise OSError(f"completing the disks' copies failed: {'; '.join(failed[:3])}")
