"""The peer ring: each host's memory tier holds another host's share of the newest spread checkpoint.

A checkpoint spread over hosts' own disks loses a host's files with the host. After each commit the disks'
leaders (the lowest rank writing to each disk), in rank order, pass their shares round a ring over the
process group: each sends the files placed on its disk to the next leader and receives the previous one's
into its node's memory tier (``REWIND_MEMORY_ROOT``, under ``.ring/<run>/``), each file held to its manifest
entry as it arrives, the manifest written last; the run's older ring copies are then let go (the newest
``REWIND_MEMORY_KEEP`` stay). A checkpoint whose incoming share does not fit some host's memory budget is
not passed at all. The bytes live on the memory filesystem, not in a process: a crash of every rank leaves
them, the loss of the host takes them (its next host holds its share, not its own).

A restore (``assemble``) asks each disk's leader what its memory holds of the checkpoint (``held``): the
files of a ring copy whose manifest is the checkpoint's, each hashed again against its entry; a copy with
a file that does not prove is removed and none of it offered (the next copy is used). Nothing read back is
trusted on its name: a ring copy proves itself file by file, like any other copy.

Passing the share never fails a save: it runs after the commit, and a failure is a warning (the disks'
copies and the shared tier's are the ones counted on). Rank 0 records each ring copy as a memory copy of
the checkpoint keyed ``ring:<host>`` (whose share it holds), so that a recovery deciding from the catalog
knows a lost host's share lives on in another's memory; a restore still finds the bytes on the host.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rewind.infra.catalog import copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.disks import MEMORY, RING_KEY
from rewind.infra.catalog.held import held_on
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint.spread import Disks
from rewind.infra.errors import ConfigError
from rewind.infra.format import manifest as mf
from rewind.infra.format import store
from rewind.infra.format.digest import hash_bytes, hash_file, manifest_digest
from rewind.infra.format.local_tier import LocalTier
from rewind.infra.memory import keeper, place

log = logging.getLogger("rewind.ring")
RING_DIR = ".ring"  # no run is named with a leading dot: never a run's memory copy


@dataclass(frozen=True, slots=True)
class Passed:
    """One leader's part of passing a checkpoint round the ring: bytes sent to the next host, bytes kept
    from the previous one, the ring copy made (None when the received share did not prove), the memory
    tier holding it and the host whose share it is."""

    sent: int
    received: int
    directory: Path | None
    holder: LocalTier | None = None
    source_host: str = ""


def _config() -> place.MemoryConfig | None:
    try:
        return place.config()
    except ConfigError as exc:
        log.warning("no peer ring: %s", exc)
        return None


def enabled(disks: Disks) -> bool:
    """Collective: whether the ranks pass their shares round a ring (the checkpoint is spread over hosts'
    disks and every disk's leader has a memory tier); the same answer on every rank."""
    if not disks.spread:  # the same on every rank: no collective needed to say no
        return False
    ok = not disks.leads(dist.get_rank()) or _config() is not None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, ok)
    return all(every)


def neighbours(disks: Disks, rank: int) -> tuple[int, int]:
    """The leaders before and after ``rank``'s in the ring (the leaders in rank order, wrapping round)."""
    leaders = sorted({disks.leader(r) for r in range(len(disks.of_rank))})
    at = leaders.index(disks.leader(rank))
    return leaders[at - 1], leaders[(at + 1) % len(leaders)]


def share(manifest: mf.Manifest, disk: str) -> list[mf.FileEntry]:
    """The files placed on ``disk``, in the manifest's order."""
    return [e for e in manifest.files if manifest.placement.get(e.path) == disk]


def pass_on(directory: Path, run: str, disks: Disks, group: dist.ProcessGroup | None = None) -> Passed | None:
    """Collective over ``group`` (every rank calls it): the committed checkpoint at ``directory`` passed
    round the ring; this leader's part (None on other ranks, or when some leader cannot take part)."""
    rank = dist.get_rank()
    prev, nxt = neighbours(disks, rank)
    ready = _ready(directory, run, disks, prev) if disks.leads(rank) else None
    why = ready if isinstance(ready, str) else ""
    digest = manifest_digest(ready[1]) if ready is not None and not isinstance(ready, str) else None
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (why, digest), group=group)
    whys = [w for w, _ in every if w]
    if len({d for _, d in every if d}) > 1:  # every disk's copy must be this checkpoint's: else sizes differ
        whys.append("the disks' copies hold different checkpoints")
    if whys:
        if ready is not None:
            log.warning("%s not passed round the peer ring: %s", directory, whys[0])
        if not isinstance(ready, (str, type(None))):
            shutil.rmtree(ready[3], ignore_errors=True)
        return None
    if ready is None or isinstance(ready, str):
        return None
    cfg, raw, manifest, target = ready
    incoming = share(manifest, disks.of_rank[prev].id)
    outgoing = share(manifest, disks.of_rank[rank].id)
    sent, received, errors = _exchange(directory, outgoing, incoming, target, (prev, nxt), group)
    try:
        if errors:
            raise OSError(errors[0])
        kept = _commit(target, raw, manifest.step)
        _let_go(kept.parent, keep=cfg.keep)
    except OSError as exc:
        shutil.rmtree(target, ignore_errors=True)
        log.warning("%s step %d: the peer's share not kept in memory: %s", run, manifest.step, exc)
        return Passed(sent, 0, None)
    return Passed(sent, received, kept, keeper.mark(cfg), disks.of_rank[prev].host)


def gathered(mine: Passed | None, group: dist.ProcessGroup | None = None) -> list[Passed]:
    """Collective: every leader's ring copy made by this pass."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return [p for p in every if isinstance(p, Passed) and p.directory is not None and p.holder is not None]


def register(cat: Catalog, checkpoint_id: int, run: str, passed: list[Passed]) -> None:
    """Rank 0: each ring copy a memory copy of the checkpoint (``ring:<host>``: that host's share, volatile),
    and the run's older ring copies on the same memory tiers recorded let go, as the hosts let them go."""
    cfg = _config()
    keep = cfg.keep if cfg is not None else 1
    for p in passed:
        if p.holder is None:
            continue
        copies.add(cat, checkpoint_id, MEMORY, str(p.directory), key=f"{RING_KEY}{p.source_host}",
                   nbytes=p.received, status=R.VERIFIED, disk=p.holder)  # fmt: skip
        older = [h for h in held_on(cat, MEMORY, p.holder.id)
                 if h.run == run and f"/{RING_DIR}/" in h.uri and h.checkpoint_id != checkpoint_id]  # fmt: skip
        for h in older[: max(0, len(older) - (keep - 1))]:  # oldest step first
            copies.record(cat, h.replica_id, R.DELETED, "let go from the peer ring")


Ready = tuple[place.MemoryConfig, bytes, mf.Manifest, Path]


def _ready(directory: Path, run: str, disks: Disks, prev: int) -> Ready | str:
    """A leader's memory tier, the committed manifest (bytes, parsed) and the directory the peer's share
    goes to; or why it cannot take part: every leader must agree before any byte is sent."""
    try:
        raw = (directory / mf.MANIFEST_NAME).read_bytes()
        manifest = mf.parse(raw)
    except (OSError, mf.ManifestError) as exc:
        return f"the committed manifest cannot be read: {exc}"
    cfg = _config()
    if cfg is None:
        return "a host has no memory tier"
    need = sum(e.size for e in share(manifest, disks.of_rank[prev].id))
    if need > cfg.budget_bytes:
        return f"a host's memory budget ({cfg.budget_bytes} bytes) cannot hold {need} bytes"
    try:
        return cfg, raw, manifest, _incoming_dir(cfg, run)
    except (OSError, ConfigError) as exc:
        return f"a host's memory tier cannot take its peer's share: {exc}"


def _incoming_dir(cfg: place.MemoryConfig, run: str) -> Path:
    keeper.mark(cfg)  # the memory tier's directory, this user's alone, never a link
    parent = cfg.root / RING_DIR / mf.safe_relative(run)
    parent.mkdir(parents=True, exist_ok=True)
    target = parent / f".incoming-{os.getpid()}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    return target


def _exchange(
    directory: Path,
    outgoing: list[mf.FileEntry],
    incoming: list[mf.FileEntry],
    target: Path,
    peers: tuple[int, int],
    group: dist.ProcessGroup | None,
) -> tuple[int, int, list[str]]:
    """Send ``outgoing`` to the next leader while receiving ``incoming`` from the previous one, a file at a
    time (at most one file each way in memory); (bytes sent, bytes kept, errors). Empty files are written,
    not sent. Every message is exchanged whatever failed: the ring's peers must never wait on this one."""
    prev, nxt = peers
    send = [e for e in outgoing if e.size]
    recv = [e for e in incoming if e.size]
    sent = received = 0
    errors = [err for e in incoming if not e.size for err in _keep(target, e, b"")]
    for i in range(max(len(send), len(recv))):
        work = dist.isend(_read(directory, send[i]), dst=nxt, group=group) if i < len(send) else None
        if i < len(recv):
            buf = torch.empty(recv[i].size, dtype=torch.uint8)
            dist.recv(buf, src=prev, group=group)
            failed = _keep(target, recv[i], buf.numpy().tobytes())
            errors += failed
            received += 0 if failed else recv[i].size
        if work is not None:
            work.wait()
            sent += send[i].size
    return sent, received, errors


def _read(directory: Path, entry: mf.FileEntry) -> torch.Tensor:
    """A file's bytes to send; zeros when it cannot be read as the manifest sizes it (no receiver keeps
    them: they do not hash to the entry)."""
    try:
        raw = (directory / mf.safe_relative(entry.path)).read_bytes()
    except OSError as exc:
        log.warning("%s not sent round the ring: %s", entry.path, exc.strerror or exc)
        raw = b""
    if len(raw) != entry.size:
        return torch.zeros(entry.size, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _keep(target: Path, entry: mf.FileEntry, raw: bytes) -> list[str]:
    """Write a received file into the ring copy once its bytes are the manifest's; the error, if any."""
    got = hash_bytes(raw)
    if (got.size, got.xxh3) != (entry.size, entry.xxh3):
        return [f"{entry.path} as received differs from the manifest's entry"]
    path = target / mf.safe_relative(entry.path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)  # memory: nothing to sync; the manifest, written last, makes the copy whole
    except OSError as exc:
        return [f"{entry.path}: {exc.strerror or exc}"]
    return []


def _commit(target: Path, raw: bytes, step: int) -> Path:
    """The ring copy complete: its manifest written last, then renamed to its checkpoint's name."""
    (target / mf.MANIFEST_NAME).write_bytes(raw)
    final = target.parent / f"step-{step}-{manifest_digest(raw)[:16]}"
    shutil.rmtree(final, ignore_errors=True)  # the same checkpoint passed again (a save retried)
    os.replace(target, final)
    return final


def _copies(run_dir: Path) -> Iterator[tuple[int, Path]]:
    """The run's complete ring copies on this node, with their steps."""
    for d in run_dir.glob("step-*-*"):
        step = d.name.split("-")[1]
        if step.isdigit() and (d / mf.MANIFEST_NAME).is_file():
            yield int(step), d


def _let_go(run_dir: Path, *, keep: int) -> None:
    """The run's ring copies past the newest ``keep`` removed, with any transfer left unfinished."""
    newest = sorted(_copies(run_dir), key=lambda c: c[0], reverse=True)
    for _, d in newest[keep:]:
        shutil.rmtree(d, ignore_errors=True)
    for d in run_dir.glob(".incoming-*"):
        pid = d.name.rpartition("-")[2]
        if pid.isdigit() and not store.pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def held(raw: bytes, manifest: mf.Manifest) -> dict[str, Path]:
    """The checkpoint's files (manifest ``raw``) this node's memory tier holds in a ring copy, each hashed
    against its entry: path -> file. A ring copy with a file that does not prove is refused and removed."""
    cfg = _config()
    if cfg is None or not (cfg.root / RING_DIR).is_dir():
        return {}
    found: dict[str, Path] = {}
    for m in (cfg.root / RING_DIR).glob(f"*/step-*-*/{mf.MANIFEST_NAME}"):
        try:
            if m.read_bytes() != raw:
                continue
        except OSError:
            continue
        found.update(_proven(m.parent, manifest))
    return found


def _proven(copy: Path, manifest: mf.Manifest) -> dict[str, Path]:
    got: dict[str, Path] = {}
    for e in manifest.files:
        path = copy / mf.safe_relative(e.path)
        if not path.is_file():
            continue
        try:
            digest = hash_file(path, with_crc=False)
        except OSError:
            digest = None
        if digest is None or (digest.size, digest.xxh3) != (e.size, e.xxh3):
            log.warning(
                "ring copy %s: %s differs from the manifest's entry: refused and removed", copy, e.path
            )
            shutil.rmtree(copy, ignore_errors=True)
            return {}
        got[e.path] = path
    return got
