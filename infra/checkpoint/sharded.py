"""Multi-rank checkpoints through torch.distributed.checkpoint (DCP), with Rewind's integrity.

Every rank writes its own shards (DCP), hashes the files it wrote and reports
their digests; rank 0 writes the manifest, renames the directory and commits it
only after every rank succeeded. A checkpoint saved by W ranks loads into W'
ranks (DCP reshards), optimizer state included.

DCP would pickle non-tensor values (learning rates, betas, steps) and load them
with an unrestricted ``torch.load``; Rewind hands DCP tensors only and keeps
the rest of the tree in JSON (``state.json``). DCP's own ``.metadata`` is still
a pickle, so loading first proves every file, ``.metadata`` included, against
the manifest: only bytes Rewind wrote are ever unpickled.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import CheckpointStatus as S
from infra.checkpoint import manifest as mf
from infra.checkpoint import store, tree
from infra.checkpoint.audit import record_corrupt
from infra.checkpoint.engine import recorded_save
from infra.checkpoint.state import environment
from infra.checkpoint.verify import Finding, Problem, verify_directory
from infra.digest import hash_file
from infra.errors import CorruptCheckpoint

RANK_STATE = "rank-{rank}.json"
SHARED_STATE = "state.json"


def _rank_state_file(rank: int) -> str:
    return RANK_STATE.format(rank=rank)


def save(
    run_dir: Path,
    run: str,
    step: int,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    *,
    layout: dict[str, int],
    metrics: dict[str, float] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the committed directory on every rank.

    ``state`` is the same tree on every rank (model and optimizer state dicts with
    sharded or replicated tensors); ``rank_state`` is this rank's own JSON-able state.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list[Any] = [str(store.temp_dir(run_dir, step)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    error: str | None = None
    entries: list[mf.FileEntry] = []
    try:
        shared_tree, tensors = tree.split(state, "s")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
        json_tree, extra = tree.split(rank_state, f"rank{rank}")
        if extra:
            raise TypeError("per-rank state must not hold tensors; put them in the sharded state")
        entries.append(
            store.write_file(
                tmp / _rank_state_file(rank), lambda out: out.write(json.dumps(json_tree).encode())
            )
        )
        if rank == 0:
            entries.append(
                store.write_file(tmp / SHARED_STATE, lambda out: out.write(json.dumps(shared_tree).encode()))
            )
        for p in sorted(tmp.glob(f"__{rank}_*.distcp")):
            d = hash_file(p)
            entries.append(mf.FileEntry(p.name, d.size, d.xxh3, d.crc32c))
    except Exception as exc:  # reported to rank 0, which then refuses to commit
        error = f"rank {rank}: {exc}"
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (error, entries))
    errors = [e for e, _ in gathered if e]
    final = store.step_dir(run_dir, step)
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            if errors:
                raise RuntimeError("; ".join(errors))
            files = [e for _, es in gathered for e in es]
            d = hash_file(tmp / ".metadata")
            files.append(mf.FileEntry(".metadata", d.size, d.xxh3, d.crc32c))
            store.fsync_dir(tmp)
            manifest = mf.Manifest(
                run=run,
                step=step,
                files=tuple(sorted(files, key=lambda e: e.path)),
                created_at=datetime.now(UTC).isoformat(),
                layout=layout,
                environment=environment(),
                metrics=metrics or {},
            )
            store.commit(tmp, manifest)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome[0] = str(exc)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0]:
        raise RuntimeError(f"sharded save of step {step} failed: {outcome[0]}")
    return final


def load(directory: Path, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: verify everything (rank 0, deep), then load into ``state``'s tensors in place.

    Returns (the saved tree with the loaded tensors, this rank's own state). A
    rank that did not exist when the checkpoint was saved gets rank 0's state.
    """
    rank = dist.get_rank()
    verdict: list[Any] = [None]
    if rank == 0:
        report = verify_directory(directory, deep=True)
        verdict[0] = None if report.ok else [f.as_dict() for f in report.findings if f.fatal]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise CorruptCheckpoint(
            str(directory), [Finding(Problem(f["problem"]), f["path"], f["detail"]) for f in verdict[0]]
        )
    _, tensors = tree.split(state, "s")  # the same names as at save time: where to load into
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(directory)))
    restored = tree.join(json.loads((directory / SHARED_STATE).read_text()), tensors)
    own = directory / _rank_state_file(rank)
    path = own if own.exists() else directory / _rank_state_file(0)
    return restored, tree.join(json.loads(path.read_text()), {})


def layout_of(world: int) -> dict[str, int]:
    return {"world_size": world, "tp": 1, "pp": 1, "dp": world}


class ShardedCheckpointer:
    """The multi-rank counterpart of ``Checkpointer``: every rank calls every method.

    Rank 0 alone talks to the catalog; the others learn its decisions through
    broadcasts, so all ranks always load the same checkpoint.
    """

    def __init__(self, run: str, *, root: Path, catalog: Any = None) -> None:
        self.run = run
        self.run_dir = Path(root).expanduser().resolve() / run
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.catalog = (catalog or Catalog()) if self.rank == 0 else None
        self.run_id = lineage.ensure_run(self.catalog, run) if self.catalog else None
        self._parent_id: int | None = None
        if self.rank == 0:
            store.sweep_temp(self.run_dir)
        dist.barrier()

    def save(
        self,
        step: int,
        state: dict[str, Any],
        rank_state: dict[str, Any],
        metrics: dict[str, float] | None = None,
    ) -> None:
        recording = (
            recorded_save(
                self.catalog,
                self.run_id,
                self.run_dir,
                step,
                parent_id=self._parent_id,
                layout=layout_of(self.world),
                environment=environment(),
            )
            if self.catalog is not None
            else contextlib.nullcontext((None, None))
        )
        with recording as (ck_id, _):
            final = save(
                self.run_dir, self.run, step, state, rank_state, layout=layout_of(self.world), metrics=metrics
            )
            if self.catalog is not None:
                lineage.commit(self.catalog, ck_id, mf.read(final), stall_s=None, uri=str(final))
                self._parent_id = ck_id
        dist.barrier()  # no rank goes on before the checkpoint is committed

    def restore_latest(self, state: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """(step, restored tree, this rank's state) of the newest checkpoint that verifies, or None."""
        box: list[Any] = [None]
        if self.catalog is not None:
            box[0] = [(c.id, c.step, c.path) for c in lineage.restorable(self.catalog, self.run_id)]
        dist.broadcast_object_list(box, src=0)
        for ck_id, step, path in box[0]:
            try:
                restored, mine = load(Path(path), state)
            except CorruptCheckpoint as exc:
                if self.catalog is not None:
                    record_corrupt(self.catalog, lineage.get_checkpoint(self.catalog, ck_id), exc.findings)
                continue
            if self.catalog is not None:
                lineage.transition(self.catalog, ck_id, (S.COMMITTED,), S.VERIFIED)
                self._parent_id = ck_id
            return step, restored, mine
        return None
