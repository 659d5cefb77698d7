"""The save protocol of a multi-rank checkpoint: every rank writes its DCP shards and JSON and reports the
digests; rank 0 commits (manifest, rename, catalog row) only once every rank reported for the same step,
and every rank learns the outcome, rank 0's own failures included. Used by
:class:`rewind.infra.checkpoint.sharded.ShardedCheckpointer`, synchronously or from each rank's
background thread over a group of its own."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rewind.infra.checkpoint.state import environment, writer
from rewind.infra.errors import ConfigError, RankFailed
from rewind.infra.faults import fault_point
from rewind.infra.format import manifest as mf
from rewind.infra.format import store, tree
from rewind.infra.format.digest import hash_file

RANK_STATE = "rank-{rank}.json"
SHARED_STATE = "state.json"


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
    shared_tree, tensors = tree.split(state, "s")
    json_tree, extra = tree.split(rank_state, f"rank{rank}")
    if extra:
        raise ConfigError("per-rank state must not hold tensors; put them in the sharded state")
    return RankShare(tensors, json.dumps(shared_tree).encode(), json.dumps(json_tree).encode())


def failed_share(exc: BaseException) -> RankShare:
    return RankShare({}, b"", b"", error=f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True, slots=True)
class LeadHooks:
    """Rank 0's catalog side of a save, run inside the protocol so every rank hears of its failure:
    ``begin`` before any rank writes, ``commit(final, digest)`` before the outcome is announced."""

    begin: Callable[[], None]
    commit: Callable[[Path, str], None]


def save(
    run_dir: Path,
    run: str,
    step: int,
    share: RankShare,
    *,
    layout: dict[str, int],
    metrics: dict[str, float] | None = None,
    parent: tuple[int, str | None] | None = None,
    group: dist.ProcessGroup | None = None,
    lead: LeadHooks | None = None,
) -> tuple[Path, str]:
    """Collective over ``group`` (default: the whole world): every rank calls it with its own share.
    Returns the committed directory and its manifest digest, on every rank; raises ``RankFailed`` on
    every rank otherwise. Nothing is committed unless every rank wrote and hashed its files for the
    same step, and a failure of rank 0's catalog work (``lead``) reaches every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list[Any] = [_open(run_dir, step, lead) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    kind, value, lead_step = box[0]
    if kind == "error":
        raise RankFailed(f"sharded save of step {step} failed on rank 0 before any rank wrote: {value}")
    tmp = Path(value)
    error: str | None = share.error and f"rank {rank}: {share.error}"
    if error is None and lead_step != step:  # a rank out of step with rank 0: never mix two steps
        error = f"rank {rank} is saving step {step}, rank 0 step {lead_step}"
    entries: list[mf.FileEntry] = []
    if error is None:
        try:
            entries = _write_rank(tmp, rank, step, share, group)
        except Exception as exc:  # reported to rank 0, which then refuses to commit
            error = f"rank {rank}: {exc}"
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (error, entries), group=group)
    outcome: list[Any] = [None]
    if rank == 0:
        outcome[0] = _close(
            tmp, run, step, gathered, layout=layout, metrics=metrics, parent=parent, lead=lead
        )
    dist.broadcast_object_list(outcome, src=0, group=group)
    kind, value = outcome[0]
    if kind == "error":
        raise RankFailed(f"sharded save of step {step} failed: {value}")
    return store.step_dir(run_dir, step), value


def _open(run_dir: Path, step: int, lead: LeadHooks | None) -> tuple[str, str, int]:
    """Rank 0: the catalog's row begun and a fresh temporary directory, or why not."""
    try:
        if lead is not None:
            lead.begin()
        return "go", str(store.temp_dir(run_dir, step)), step
    except Exception as exc:
        return "error", f"{type(exc).__name__}: {exc}", step


def _close(
    tmp: Path,
    run: str,
    step: int,
    gathered: list[Any],
    *,
    layout: dict[str, int],
    metrics: dict[str, float] | None,
    parent: tuple[int, str | None] | None,
    lead: LeadHooks | None,
) -> tuple[str, str]:
    """Rank 0: commit every rank's files (and the catalog row) or remove them; the outcome to announce."""
    try:
        errors = [e for e, _ in gathered if e]
        if errors:
            raise RankFailed("; ".join(errors))
        files = [e for _, es in gathered for e in es]
        digest = _commit(tmp, run, step, files, layout=layout, metrics=metrics, parent=parent)
        if lead is not None:
            lead.commit(store.step_dir(tmp.parent, step), digest)
        return "ok", digest
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return "error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, RankFailed) else str(exc)


def _write_rank(
    tmp: Path, rank: int, step: int, share: RankShare, group: dist.ProcessGroup | None
) -> list[mf.FileEntry]:
    """This rank's share: its DCP shards, its own JSON state (and, on rank 0, the shared tree); their entries."""
    entries: list[mf.FileEntry] = []
    writer_ = dcp.FileSystemWriter(str(tmp), sync_files=True)
    dcp.save(share.tensors, storage_writer=writer_, process_group=group)
    entries.append(store.write_file(tmp / rank_state_file(rank), store.bytes_writer(share.rank_json)))
    fault_point("save.shard_written", step)  # this rank's files are down, none committed yet
    if rank == 0:
        entries.append(store.write_file(tmp / SHARED_STATE, store.bytes_writer(share.shared_json)))
    for p in sorted(tmp.glob(f"__{rank}_*.distcp")):
        d = hash_file(p)
        entries.append(mf.FileEntry(p.name, d.size, d.xxh3, d.crc32c))
    return entries


def _commit(
    tmp: Path,
    run: str,
    step: int,
    files: list[mf.FileEntry],
    *,
    layout: dict[str, int],
    metrics: dict[str, float] | None,
    parent: tuple[int, str | None] | None,
) -> str:
    """Rank 0: every rank's files plus DCP's metadata under one manifest, committed; its digest."""
    d = hash_file(tmp / ".metadata")
    files = [*files, mf.FileEntry(".metadata", d.size, d.xxh3, d.crc32c)]
    store.fsync_dir(tmp)
    manifest = mf.Manifest(
        run=run,
        step=step,
        files=tuple(sorted(files, key=lambda e: e.path)),
        parent_step=None if parent is None else parent[0],
        parent_digest=None if parent is None else parent[1],
        writer=writer("rewind.ShardedCheckpointer"),
        created_at=datetime.now(UTC).isoformat(),
        layout=layout,
        environment=environment(),
        metrics=metrics or {},
    )
    return store.commit(tmp, manifest).digest
