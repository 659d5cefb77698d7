"""The save protocol of a multi-rank checkpoint: every rank writes its DCP shards and JSON and reports the
digests; rank 0 commits (manifest, rename, catalog row) only once every rank reported for the same step,
and every rank learns the outcome, rank 0's own failures included. Used by
:class:`rewind.infra.checkpoint.sharded.ShardedCheckpointer`, synchronously or from each rank's
background thread over a group of its own."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rewind.infra.checkpoint import spread
from rewind.infra.checkpoint.spread import SHARED_STATE, Disks
from rewind.infra.checkpoint.state import environment, writer
from rewind.infra.errors import ConfigError, Fenced, RankFailed
from rewind.infra.faults import fault_point
from rewind.infra.format import dcp_packs, packs, payload, store, tree
from rewind.infra.format import manifest as mf
from rewind.infra.format.dcp_direct import DirectWriter
from rewind.infra.format.digest import hash_file, manifest_digest
from rewind.infra.format.local_tier import LocalTier

RANK_STATE = "rank-{rank}.json"
RANK_FILE = re.compile(r"rank-(\d+)\.json")
OWN_VALUES = "__own_values__"  # in a rank's state file: its own state tree's non-tensor values (ranks > 0)

log = logging.getLogger(__name__)


def rank_state_file(rank: int) -> str:
    return RANK_STATE.format(rank=rank)


@dataclass(frozen=True, slots=True)
class RankShare:
    """What one rank writes of a sharded save, frozen at the call: its tensors (live, or staged copies)
    and its JSON (the shared tree, written by rank 0, and the rank's own state) already serialised; or
    why this rank could not take part (``error``), told to every rank through the save's protocol."""

    tensors: dict[str, Any]
    shared_json: bytes
    rank_json: bytes
    error: str | None = None


def share_of(state: dict[str, Any], rank_state: dict[str, Any], rank: int) -> RankShare:
    """Rank 0's non-tensor values are the shared tree; every other rank keeps its own with its rank state
    (``OWN_VALUES``), for the keys rank 0 has not got (a pipeline stage's parameters' hyperparameters)."""
    shared_tree, tensors = tree.split(state, "s")
    json_tree, extra = tree.split(rank_state, f"rank{rank}")
    if extra:
        raise ConfigError("per-rank state must not hold tensors; put them in the sharded state")
    if rank:
        json_tree = {**json_tree, OWN_VALUES: shared_tree}
    return RankShare(tensors, json.dumps(shared_tree).encode(), json.dumps(json_tree).encode())


def failed_share(exc: BaseException) -> RankShare:
    return RankShare({}, b"", b"", error=f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True, slots=True)
class LeadHooks:
    """Rank 0's catalog side of a save, run inside the protocol so every rank hears of its failure:
    ``begin`` before any rank writes, ``aside(moved)`` once other disks committed (or failed to), with what
    each held at the step (a copy of a timeline the run left moved aside, or nothing: the rows naming it
    follow it, or are let go), ``displace(final)`` at rank 0's rename, and ``commit(final, digest, also_on)``
    before the outcome is announced."""

    begin: Callable[[], None]
    # (committed directory, manifest digest, the copies on other disks: (directory, disk))
    commit: Callable[[Path, str, Sequence[tuple[str, LocalTier]]], None]
    # what other disks held at this step: (moved aside from and to, or nothing there; the disk)
    aside: Callable[[Sequence[tuple[spread.Moved, LocalTier]]], None] = lambda moved: None
    # what moves rank 0's directory already at the step aside at the rename (its rows following it): the
    # checkpoint it holds stays the run's until this one commits (``displaced.Displacer``)
    displace: Callable[[Path], None] | None = None


def save(
    run_dir: Path,
    run: str,
    step: int,
    share: RankShare,
    *,
    layout: dict[str, Any],
    metrics: dict[str, float] | None = None,
    parent: tuple[int, str | None] | None = None,
    group: dist.ProcessGroup | None = None,
    lead: LeadHooks | None = None,
    disks: Disks | None = None,
    fmt: str = payload.PLAIN,
) -> tuple[Path, str]:
    """Collective over ``group`` (default: the whole world): every rank calls it with its own share.
    Returns the committed directory and its manifest digest, on every rank; raises ``RankFailed`` on
    every rank otherwise. Nothing is committed unless every rank wrote and hashed its files for the
    same step, and a failure of rank 0's catalog work (``lead``) reaches every rank. ``disks``: where
    the ranks' roots lie; spread over several, each rank writes into its own (``spread``). ``fmt``: the DCP
    shards as they are (``plain``), or in packs linked from the parent where unchanged (``chunked``,
    :mod:`rewind.infra.format.dcp_packs`; the parent is rank 0's, told to every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list[Any] = [(*_open(run_dir, step, lead), parent) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    kind, value, lead_step, parent = box[0]
    if kind == "error":
        raise RankFailed(f"sharded save of step {step} failed on rank 0 before any rank wrote: {value}")
    tmp = run_dir / Path(value).name  # this rank's disk: rank 0's directory, or its namesake on another disk
    error, link_from = _ready_to_write(tmp, rank, step, lead_step, share, run_dir, parent, fmt)
    # every rank enters DCP's collectives, or none does: one left out would leave the others waiting in them
    ready: list[Any] = [None] * world
    dist.all_gather_object(ready, error is None, group=group)
    entries: list[mf.FileEntry] = []
    if all(ready):
        try:
            entries = _write_rank(tmp, rank, step, share, group, fmt=fmt, link_from=link_from)
        except Exception as exc:  # reported to rank 0, which then refuses to commit
            error = f"rank {rank}: {exc}"
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (error, entries), group=group)
    facts = _Facts(run, step, layout, metrics, parent)
    if disks is not None and disks.spread:
        digest = _close_spread(tmp, gathered, facts, disks=disks, group=group, lead=lead)
        return store.step_dir(run_dir, step), digest
    outcome: list[Any] = [None]
    if rank == 0:
        outcome[0] = _close(tmp, gathered, facts, lead=lead)
    dist.broadcast_object_list(outcome, src=0, group=group)
    kind, value = outcome[0]
    if kind == "error":
        raise RankFailed(f"sharded save of step {step} failed: {value}")
    return store.step_dir(run_dir, step), value


@dataclass(frozen=True, slots=True)
class _Facts:
    """What rank 0's manifest says of a save besides its files."""

    run: str
    step: int
    layout: dict[str, Any]
    metrics: dict[str, float] | None
    parent: tuple[int, str | None] | None


def _close_spread(
    tmp: Path,
    gathered: list[Any],
    facts: _Facts,
    *,
    disks: Disks,
    group: dist.ProcessGroup | None,
    lead: LeadHooks | None,
) -> str:
    """The commit of a save spread over disks: rank 0 prepares the manifest, every other disk's leader
    commits its copy, then rank 0 commits its own and the catalog's row; the digest, on every rank."""
    rank = dist.get_rank()
    box: list[Any] = [_prepare_spread(tmp, gathered, facts, disks) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    kind, value = box[0]
    other_leader = rank != 0 and disks.leads(rank) and disks.leader(rank) != disks.leader(0)
    if kind == "error":
        if other_leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RankFailed(f"sharded save of step {facts.step} failed: {value}")
    mine: tuple[str | None, str | None, spread.Moved | None] = (None, None, None)
    if other_leader:
        aside: list[spread.Moved] = []
        try:
            mine = (None, str(spread.commit_share(tmp, value, aside)), aside[0])
        except Exception as exc:
            _remove_written(tmp, facts.step, value.raw)
            why = f"rank {rank} ({disks.of_rank[rank].host}): {type(exc).__name__}: {exc}"
            mine = (why, None, aside[0] if aside else None)  # a copy moved aside is told all the same
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    outcome: list[Any] = [_finish_spread(tmp, value, reports, disks, lead, facts.step) if rank == 0 else None]
    dist.broadcast_object_list(outcome, src=0, group=group)
    kind, digest, put_back = outcome[0]
    if kind == "error":
        spread.undo(Path(mine[1]) if mine[1] else None, value.raw, mine[2] if put_back else None)
        raise RankFailed(f"sharded save of step {facts.step} failed: {digest}")
    return str(digest)


def _prepare_spread(tmp: Path, gathered: list[Any], facts: _Facts, disks: Disks) -> tuple[str, Any]:
    """Rank 0: every rank's files under one manifest that places them on their disks, or why not."""
    try:
        errors = [e for e, _ in gathered if e]
        if errors:
            raise RankFailed("; ".join(errors))
        own = [[e for e in es if e.path not in spread.COMMON] for _, es in gathered]
        files = [e for _, es in gathered for e in es]
        manifest = _manifest(tmp, files, facts, placement=disks.placement(own), disks=disks.hosts())
        return "go", spread.prepare(tmp, manifest)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return "error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, RankFailed) else str(exc)


def _finish_spread(
    tmp: Path, prepared: spread.Prepared, reports: list[Any], disks: Disks, lead: LeadHooks | None, step: int
) -> tuple[str, str, bool]:
    """Rank 0, once every other disk's copy is renamed in: its own copy and the catalog's commit; the outcome,
    its digest or why not, and (failed) whether the other disks put back the copies they moved aside."""
    final: Path | None = None
    aside = [(moved, disks.of_rank[r]) for r, (_, _, moved) in enumerate(reports) if moved]
    rows_aside = False
    try:
        if lead is not None and aside:  # the rows follow the bytes, before any row may name the new ones
            lead.aside(aside)
            rows_aside = True
        errors = [e for e, _, _ in reports if e]
        if errors:
            raise RankFailed("; ".join(errors))
        done = store.commit(tmp, mf.parse(prepared.raw), prepared.raw, displace=_displace(lead))
        final = done.path
        if lead is not None:
            also = [(path, disks.of_rank[r]) for r, (_, path, _) in enumerate(reports) if path]
            lead.commit(final, done.digest, also)
        return "ok", done.digest, False
    except Exception as exc:
        if final is None:
            _remove_written(tmp, step, prepared.raw)
        else:  # renamed, then the catalog's commit failed
            _remove_own(final, manifest_digest(prepared.raw))
        # fenced off: the run is another writer's, whose copies may lie at the step now; nothing is put back
        put_back = not isinstance(exc, Fenced) and (not rows_aside or _rows_back(lead, aside))
        why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RankFailed) else str(exc)
        return "error", why, put_back


def _rows_back(lead: LeadHooks | None, aside: Sequence[tuple[spread.Moved, LocalTier]]) -> bool:
    """The save failed: the rows of other disks' copies moved aside follow them back, before their leaders
    put the copies back (``spread.undo``); False where the catalog could not be told: the copies then stay
    aside with their rows."""
    back = [(spread.Moved(m.new, m.old), disk) for m, disk in aside if m.new is not None]
    if lead is None or not back:
        return True
    try:
        lead.aside(back)
    except Exception as exc:
        log.warning("the copies moved aside stay there: their rows could not be moved back (%s)", exc)
        return False
    return True


def _displace(lead: LeadHooks | None) -> Callable[[Path], None] | None:
    return lead.displace if lead is not None else None


def _remove_own(final: Path, digest: str) -> None:
    """The step's directory removed if it still holds this save's manifest (whose digest is ``digest``),
    never another writer's renamed in since."""
    with contextlib.suppress(OSError):
        if manifest_digest((final / mf.MANIFEST_NAME).read_bytes()) == digest:
            shutil.rmtree(final, ignore_errors=True)


def _remove_written(tmp: Path, step: int, raw: bytes) -> None:
    """This save's copy on this disk removed: its temporary directory, or, once renamed (a commit that failed
    syncing the run's directory after it), the step's, if that holds this save's manifest (never another's)."""
    if tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        return
    final = store.step_dir(tmp.parent, step)
    with contextlib.suppress(OSError):
        if (final / mf.MANIFEST_NAME).read_bytes() == raw:
            shutil.rmtree(final, ignore_errors=True)


def _open(run_dir: Path, step: int, lead: LeadHooks | None) -> tuple[str, str, int]:
    """Rank 0: the catalog's row begun and a fresh temporary directory, or why not."""
    try:
        if lead is not None:
            lead.begin()
        return "go", str(store.temp_dir(run_dir, step)), step
    except Exception as exc:
        return "error", f"{type(exc).__name__}: {exc}", step


def _close(tmp: Path, gathered: list[Any], facts: _Facts, *, lead: LeadHooks | None) -> tuple[str, str]:
    """Rank 0: commit every rank's files (and the catalog row) or remove them; the outcome to announce."""
    final, digest = None, ""
    try:
        errors = [e for e, _ in gathered if e]
        if errors:
            raise RankFailed("; ".join(errors))
        files = [e for _, es in gathered for e in es]
        done = store.commit(tmp, _manifest(tmp, files, facts), displace=_displace(lead))
        final, digest = done.path, done.digest
        if lead is not None:
            lead.commit(final, digest, ())
        return "ok", digest
    except Exception as exc:  # renamed, then the catalog's commit failed: no copy its row does not commit
        if final is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _remove_own(final, digest)
        return "error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, RankFailed) else str(exc)


def _ready_to_write(
    tmp: Path,
    rank: int,
    step: int,
    lead_step: int,
    share: RankShare,
    run_dir: Path,
    parent: tuple[int, str | None] | None,
    fmt: str,
) -> tuple[str | None, packs.Parent | None]:
    """This rank ready to write its share into ``tmp`` (made on its disk), and what a chunked save links
    from; or why it cannot (its share failed at the call, it is out of step with rank 0, its disk refused)."""
    if share.error is not None:
        return f"rank {rank}: {share.error}", None
    if lead_step != step:  # a rank out of step with rank 0: never mix two steps
        return f"rank {rank} is saving step {step}, rank 0 step {lead_step}", None
    try:
        if rank != 0:
            tmp.mkdir(parents=True, exist_ok=True)
        return None, _link_source(run_dir, parent) if fmt == payload.CHUNKED else None
    except Exception as exc:
        return f"rank {rank}: {type(exc).__name__}: {exc}", None


def _link_source(run_dir: Path, parent: tuple[int, str | None] | None) -> packs.Parent | None:
    """The parent checkpoint on this rank's disk, as a chunked save may link from it (its manifest is
    held to ``parent``'s digest, the catalog's, before anything is linked)."""
    if parent is None or not parent[1]:
        return None
    return packs.Parent(store.step_dir(run_dir, parent[0]), parent[1])


def _write_rank(
    tmp: Path,
    rank: int,
    step: int,
    share: RankShare,
    group: dist.ProcessGroup | None,
    *,
    fmt: str = payload.PLAIN,
    link_from: packs.Parent | None = None,
) -> list[mf.FileEntry]:
    """This rank's share: its DCP shards (or packs), its own JSON state (and, on rank 0, the shared tree);
    their entries."""
    entries: list[mf.FileEntry] = []
    if fmt == payload.CHUNKED:
        packed = dcp_packs.PackedWriter(tmp, rank=rank, parent=link_from)
        dcp.save(share.tensors, storage_writer=packed, process_group=group)
        entries.extend(packed.written.entries)
        raw = packed.index_bytes()
        entries.append(store.write_file(tmp / dcp_packs.index_file(rank), store.bytes_writer(raw)))
    else:  # hashed as they are written, past the page cache: nothing read back
        direct = DirectWriter(tmp)
        dcp.save(share.tensors, storage_writer=direct, process_group=group)
        entries.extend(direct.entries)
    entries.append(store.write_file(tmp / rank_state_file(rank), store.bytes_writer(share.rank_json)))
    fault_point("save.shard_written", step)  # this rank's files are down, none committed yet
    if rank == 0:
        entries.append(store.write_file(tmp / SHARED_STATE, store.bytes_writer(share.shared_json)))
    return entries


def _manifest(
    tmp: Path,
    files: list[mf.FileEntry],
    facts: _Facts,
    *,
    placement: dict[str, str] | None = None,
    disks: dict[str, str] | None = None,
) -> mf.Manifest:
    """Rank 0: every rank's files plus DCP's metadata under one manifest (the directory fsynced)."""
    d = hash_file(tmp / payload.DCP_METADATA)
    files = [*files, mf.FileEntry(payload.DCP_METADATA, d.size, d.xxh3, d.crc32c)]
    store.fsync_dir(tmp)
    parent = facts.parent
    return mf.Manifest(
        run=facts.run,
        step=facts.step,
        files=tuple(sorted(files, key=lambda e: e.path)),
        parent_step=None if parent is None else parent[0],
        parent_digest=None if parent is None else parent[1],
        writer=writer("rewind.ShardedCheckpointer"),
        created_at=datetime.now(UTC).isoformat(),
        layout=facts.layout,
        environment=environment(),
        metrics=facts.metrics or {},
        placement=placement or {},
        disks=disks or {},
    )
