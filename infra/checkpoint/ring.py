"""The peer ring: each host's memory tier holds another host's share of the newest spread checkpoint.

A checkpoint spread over hosts' own disks loses a host's files with the host. After each commit the disks'
leaders (the lowest rank writing to each disk), in rank order, pass their shares round a ring over the
process group: each sends the files placed on its disk to the next leader and receives the previous one's
into its node's memory tier (``REWIND_MEMORY_ROOT``, under ``.ring/<run>/``), each file held to its manifest
entry as it arrives, the manifest written last; the run's older ring copies are then let go (the newest
``REWIND_MEMORY_KEEP`` stay). A checkpoint whose incoming share does not fit some host's memory budget is
not passed at all. Off the job's path (an async save's background persist; after a sync save, on each rank's
background thread), where the budget holds it too, a leader keeps its own disk's files in the same ring copy
(read from the disk once, as they are sent), so that a crash of every rank reads each host's files from its
memory; a pass inside a sync save (``REWIND_MEMORY_RING=on``) does not (its time is the job's, and the disk
holds them). The bytes live on the memory filesystem, not in a process: a crash of every rank leaves them,
the loss of the host takes them (its next host holds its share).

A restore (``assemble``) asks each disk's leader what its memory holds of the checkpoint (``held``): the
files of a ring copy whose manifest is the checkpoint's, at their entries' sizes; each is hashed against its
entry as it is taken or loaded (once), a copy with a file taken that does not prove is removed and no more
of it offered (the next copy is used), and a file loaded that does not prove is read from the disk instead.
Nothing read back is trusted on its name: a ring copy proves itself file by file, like any other copy.

Passing the share never fails a save: it runs after the commit, and a failure is a warning (the disks'
copies and the shared tier's are the ones counted on). Rank 0 records each ring copy as a memory copy of
the checkpoint keyed ``ring:<host>`` (whose share it holds), so that a recovery deciding from the catalog
knows a lost host's share lives on in another's memory; a restore still finds the bytes on the host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rewind.infra.catalog import copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.disks import MEMORY, RING_KEY
from rewind.infra.catalog.held import ring_held_by
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint import ring_wire
from rewind.infra.checkpoint.spread import Disks
from rewind.infra.errors import ConfigError
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import manifest_digest
from rewind.infra.format.local_tier import LocalTier
from rewind.infra.memory import keeper, place, ring_room

log = logging.getLogger("rewind.ring")
RING_ENV = "REWIND_MEMORY_RING"
RING_DIR = ring_room.RING_DIR


@dataclass(frozen=True, slots=True)
class Passed:
    """One leader's part of passing a checkpoint round the ring: bytes sent to the next host, bytes kept
    from the previous one, the ring copy made (None when the received share did not prove, or nothing was
    passed), the memory tier holding it and the host whose share it is."""

    sent: int
    received: int
    directory: Path | None
    holder: LocalTier | None = None
    source_host: str = ""
    evicted: tuple[str, ...] = ()  # other runs' ring copies this host let go to make room
    own: int = 0  # bytes of this host's own files kept in the same copy


def _config() -> place.MemoryConfig | None:
    """This node's memory tier; None when it is off or its setting cannot be used (never raises: a rank
    raising alone would leave the others in a collective)."""
    try:
        return place.config()
    except Exception as exc:  # ConfigError, or the memory filesystem unreadable (statvfs)
        log.warning("no peer ring: %s", exc)
        return None


def setting() -> str:
    """``REWIND_MEMORY_RING``: ``auto`` (the default: every save's shares are passed off the job's path: an
    async save's in its background persist, a sync save's on a background thread once it returned), ``on``
    (a sync save's inside the save: it returns with its ring copies made, its stall longer) or ``off``."""
    raw = os.environ.get(RING_ENV, "").strip().lower() or "auto"
    if raw not in ("auto", "on", "off"):
        raise ConfigError(f"{RING_ENV}: {raw!r} is not auto, on or off")
    return raw


def on() -> bool:
    """Whether ring copies are made or read at all (anything but ``off``)."""
    return setting() != "off"


def enabled(disks: Disks) -> bool:
    """Collective: whether the ranks pass their shares round a ring (the checkpoint is spread over hosts'
    disks, every disk's leader has a memory tier, and the setting is not ``off``); the same answer on every
    rank."""
    if not disks.spread:  # the same on every rank: no collective needed to say no
        return False
    try:
        wanted = on()
    except ConfigError as exc:
        log.warning("no peer ring: %s", exc)
        wanted = False
    mark = _mark_of(_config()) if wanted and disks.leads(dist.get_rank()) else None
    ok = wanted and (not disks.leads(dist.get_rank()) or mark is not None)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ok, mark))
    marks = [m for _, m in every if m is not None]
    if len(set(marks)) < len(marks):  # two disks, one memory: each would let the other's copies go
        log.warning("no peer ring: two hosts' disks share one memory tier")
        return False
    return all(ok for ok, _ in every)


def _mark_of(cfg: place.MemoryConfig | None) -> str | None:
    """The memory tier's id (made on first use); None when there is none it can use."""
    if cfg is None:
        return None
    try:
        return keeper.mark(cfg).id
    except Exception as exc:
        log.warning("no peer ring: %s", exc)
        return None


def neighbours(disks: Disks, rank: int) -> tuple[int, int]:
    """The leaders before and after ``rank``'s in the ring (the leaders in rank order, wrapping round)."""
    leaders = sorted({disks.leader(r) for r in range(len(disks.of_rank))})
    at = leaders.index(disks.leader(rank))
    return leaders[at - 1], leaders[(at + 1) % len(leaders)]


def share(manifest: mf.Manifest, disk: str) -> list[mf.FileEntry]:
    """The files placed on ``disk``, in the manifest's order."""
    return [e for e in manifest.files if manifest.placement.get(e.path) == disk]


def pass_on(
    directory: Path, run: str, disks: Disks, group: dist.ProcessGroup | None = None, *, own: bool = False
) -> Passed | None:
    """Collective over ``group`` (every rank calls it): the committed checkpoint at ``directory`` passed
    round the ring; this leader's part (None on other ranks, or when some leader cannot take part: then
    nothing is let go to make room). ``own``: each leader keeps its own disk's files too, budget permitting."""
    rank = dist.get_rank()
    prev, nxt = neighbours(disks, rank)
    ready = _ready(directory, run, disks, prev, rank, own=own) if disks.leads(rank) else None
    why = ready.why if isinstance(ready, Refused) else ""
    digest = manifest_digest(ready.raw) if isinstance(ready, Ready) else None
    every: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(every, (why, digest), group=group)
    except BaseException:  # a peer gone: the ended runs' locks let go, nothing of theirs
        if isinstance(ready, Ready):
            ready.eviction.release()
        raise
    whys = [w for w, _ in every if w]
    if len({d for _, d in every if d}) > 1:  # every disk's copy must be this checkpoint's: else sizes differ
        whys.append("the disks' copies hold different checkpoints")
    if whys or not isinstance(ready, Ready):
        if ready is not None:
            log.warning("%s not passed round the peer ring: %s", directory, whys[0])
        if isinstance(ready, Ready):  # nothing let go, nothing half made
            ready.eviction.release()
            shutil.rmtree(ready.target, ignore_errors=True)
        return None
    evicted = ready.eviction.commit()  # every leader agreed: the room is made now
    for path in ready.reclaim:  # this host's own files in the run's older copies: its disk holds them
        with contextlib.suppress(OSError):  # never raised alone: the peer is about to send
            path.unlink()
    return _exchange(directory, run, disks, ready, (prev, nxt), group, evicted)


def _exchange(
    directory: Path,
    run: str,
    disks: Disks,
    ready: Ready,
    peers: tuple[int, int],
    group: dist.ProcessGroup | None,
    evicted: tuple[str, ...],
) -> Passed:
    prev = peers[0]
    incoming = share(ready.manifest, disks.of_rank[prev].id)
    outgoing = share(ready.manifest, disks.of_rank[dist.get_rank()].id)
    sent = 0
    try:
        got = ring_wire.exchange(directory, outgoing, incoming, ready.target, peers, group, own=ready.own)
        sent = got.sent
        if got.errors:
            raise OSError(got.errors[0])
        kept = _commit(ready.target, ready.raw, ready.manifest.step)
    except Exception as exc:  # a peer gone mid-way raises here too: nothing half made is left
        shutil.rmtree(ready.target, ignore_errors=True)
        log.warning("%s step %d: the peer's share not kept in memory: %s", run, ready.manifest.step, exc)
        return Passed(sent, 0, None, ready.holder, evicted=evicted)
    try:
        _let_go(kept, keep=ready.cfg.keep)
    except OSError as exc:  # the new copy is whole: older ones go at the next pass
        log.warning("%s: older ring copies not let go: %s", run, exc)
    return Passed(sent, got.received, kept, ready.holder, disks.of_rank[prev].host, evicted, got.own)


def gathered(mine: Passed | None, group: dist.ProcessGroup | None = None) -> list[Passed]:
    """Collective: every leader's part of this pass (a ring copy made, other runs' copies let go)."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return [p for p in every if isinstance(p, Passed) and p.holder is not None]


def register(cat: Catalog, checkpoint_id: int, run: str, passed: list[Passed]) -> None:
    """Rank 0: each ring copy a memory copy of the checkpoint (``ring:<host>``: that host's share, volatile),
    and the run's older ring copies on the same memory tiers recorded let go, as the hosts let them go."""
    cfg = _config()
    keep = cfg.keep if cfg is not None else 1
    record_evicted(cat, run, passed)
    for p in passed:
        if p.holder is None or p.directory is None:
            continue
        copies.add(cat, checkpoint_id, MEMORY, str(p.directory), key=f"{RING_KEY}{p.source_host}",
                   nbytes=p.received + p.own, status=R.VERIFIED, disk=p.holder)  # fmt: skip
        older = [h for h in ring_held_by(cat, p.holder.host, run) if h.checkpoint_id != checkpoint_id]
        # newest made first, as the host let them go (``_let_go``); by host, not by the tier's mark: a
        # host that rebooted has a new mark, and nothing of the old one
        stale = [h for h in older if h.tier_id != p.holder.id]
        current = [h for h in older if h.tier_id == p.holder.id]
        for h in stale + current[keep - 1 :]:
            copies.record(cat, h.replica_id, R.DELETED, "let go from the peer ring")


def record_evicted(cat: Catalog, run: str, passed: list[Passed]) -> None:
    """Other runs' ring copies the hosts let go to make room for ``run``'s pass, recorded let go (whatever
    came of the pass: their bytes are gone either way)."""
    for p in passed:
        if p.holder is not None:
            ring_room.record(
                cat, p.holder.id, p.evicted, R.DELETED, f"let go from the peer ring: room for {run}"
            )


def hold(run: str) -> ring_room.Live | None:
    """This leader's hold on ``run``'s ring copies on this host while it lives: another run's pass never
    lets them go to make room. None when there is no memory tier to hold, or the ring is off (never raises)."""
    cfg = _config()
    if cfg is None:
        return None
    try:
        if not on():
            return None
        keeper.mark(cfg)  # this user's own directory, never a link
        return ring_room.Live(ring_room.run_dir(cfg.root, run))
    except Exception as exc:
        log.warning("%s: the ring copies on this host not held: %s", run, exc)
        return None


def renew(live: ring_room.Live) -> None:
    """The hold taken again if the lock file held is no longer the one there (never raises)."""
    try:
        live.renew()
    except OSError as exc:
        log.warning("the ring copies on this host not held: %s", exc)


@dataclass(frozen=True, slots=True)
class Ready:
    """A leader ready to take part: its memory tier, the committed manifest (bytes, parsed), the directory
    the peer's share goes to, other runs' ring copies chosen to make room, and its own disk's files to keep
    beside the peer's (None: the budget does not hold them too)."""

    cfg: place.MemoryConfig
    raw: bytes
    manifest: mf.Manifest
    target: Path
    holder: LocalTier
    eviction: ring_room.Eviction  # other runs' ring copies to let go for the room, once every leader agreed
    own: list[mf.FileEntry] | None = None
    # this host's own files in the run's older ring copies, removed for the room once every leader agreed
    reclaim: tuple[Path, ...] = ()


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a leader cannot take part."""

    why: str


def _ready(
    directory: Path, run: str, disks: Disks, prev: int, rank: int, *, own: bool = False
) -> Ready | Refused:
    """Whether leader ``rank`` can take part: every leader must agree before any byte is sent. Never raises.
    ``own``: keep its own disk's files too (else the peer's share alone)."""
    try:
        return _prepare(directory, run, disks, (prev, rank), own)
    except Exception as exc:  # told to the other leaders, never raised alone
        return Refused(f"{type(exc).__name__}: {exc}")


def _prepare(directory: Path, run: str, disks: Disks, ranks: tuple[int, int], own: bool) -> Ready | Refused:
    prev, disk = ranks[0], disks.of_rank[ranks[1]].id
    try:
        raw = (directory / mf.MANIFEST_NAME).read_bytes()
        manifest = mf.parse(raw)
    except (OSError, mf.ManifestError) as exc:
        return Refused(f"the committed manifest cannot be read: {exc}")
    cfg = _config()
    if cfg is None:
        return Refused("a host has no memory tier")
    need = sum(e.size for e in share(manifest, disks.of_rank[prev].id))
    try:
        holder = keeper.mark(cfg)  # the memory tier's directory, this user's alone, never a link
        target = _incoming_dir(cfg, run)
        held_now = ring_room.tier_bytes(cfg.root)  # the keeper's copies and the ring's: one budget
        mine = list(manifest.files_on(disk)) if own else []
        # this host's own files in the run's older copies can go (its disk holds them), when room is short
        short = need + held_now + sum(e.size for e in mine) > min(
            cfg.budget_bytes, held_now + _free(cfg.root)
        )
        reclaim = _reclaimable(ring_room.run_dir(cfg.root, run), disk) if short else {}
        held_now -= sum(reclaim.values())
    except (OSError, ConfigError) as exc:
        return Refused(f"a host's memory tier cannot take its peer's share: {exc}")
    eviction = ring_room.choose(cfg.root, run, need + held_now - cfg.budget_bytes)  # never raises
    if need + held_now - eviction.nbytes > cfg.budget_bytes:
        shutil.rmtree(target, ignore_errors=True)
        return Refused(f"a host's memory budget ({cfg.budget_bytes} bytes) cannot hold its peer's share "
                       f"({need} bytes) beside what its memory tier holds ({held_now} bytes; ended runs' "
                       "ring copies would not make the room)")  # fmt: skip
    room = cfg.budget_bytes - (need + held_now - eviction.nbytes)  # the peer's share first: room for its own?
    freed = sum(reclaim.values()) + eviction.nbytes  # and on the memory filesystem, whatever the budget says
    room = min(room, _free(cfg.root) + freed - need)
    kept = mine if mine and sum(e.size for e in mine) <= room else None
    return Ready(cfg, raw, manifest, target, holder, eviction, kept, tuple(reclaim))


def _free(root: Path) -> int:
    """Bytes free on the memory filesystem (0 when it cannot be read)."""
    try:
        st = os.statvfs(root)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _reclaimable(of_run: Path, disk: str) -> dict[Path, int]:
    """This host's own files (``disk``'s) in the run's older ring copies, with their sizes: the disk holds
    them, so a pass may remove them for room. Files of a copy whose manifest does not name ``disk`` are
    never counted (they would be another host's)."""
    found: dict[Path, int] = {}
    for copy in ring_room.copies(of_run):
        if copy.is_symlink():  # never through a link
            continue
        try:
            manifest = mf.parse((copy / mf.MANIFEST_NAME).read_bytes())
        except (OSError, mf.ManifestError):
            continue
        if disk not in manifest.disks:
            continue
        for e in manifest.files_on(disk):
            path = copy / mf.safe_relative(e.path)
            with contextlib.suppress(OSError):
                if stat.S_ISREG(path.lstat().st_mode):
                    found[path] = path.lstat().st_size
    return found


def _incoming_dir(cfg: place.MemoryConfig, run: str) -> Path:
    parent = ring_room.run_dir(cfg.root, run)
    parent.mkdir(parents=True, exist_ok=True)
    ring_room.sweep(parent)
    target = parent / f".incoming-{os.getpid()}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    return target


def _commit(target: Path, raw: bytes, step: int) -> Path:
    """The ring copy complete: its manifest written last, then renamed to its checkpoint's name."""
    (target / mf.MANIFEST_NAME).write_bytes(raw)
    final = target.parent / f"step-{step}-{manifest_digest(raw)[:16]}"
    shutil.rmtree(final, ignore_errors=True)  # the same checkpoint passed again (a save retried)
    os.replace(target, final)
    return final


def _let_go(kept: Path, *, keep: int) -> None:
    """The run's ring copies but ``kept`` (just made) and the newest ``keep - 1`` others removed (by when they
    were made, not by step: after a roll back the newest copy has a lower step). Transfers a dead process
    left are ``ring_room.sweep``'s."""
    others = [d for d in ring_room.copies(kept.parent) if d != kept]
    for d in others[keep - 1 :]:
        shutil.rmtree(d, ignore_errors=True)
