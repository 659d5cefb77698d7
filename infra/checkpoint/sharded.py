"""Multi-rank checkpoints through torch.distributed.checkpoint (DCP), with Rewind's integrity.

Every rank writes its own shards (DCP), hashes the files it wrote and reports
their digests; rank 0 writes the manifest, renames the directory and commits it
only after every rank succeeded. A checkpoint saved by W ranks loads into W'
ranks (DCP reshards), optimizer state included.

DCP would pickle non-tensor values (learning rates, betas, steps) and load them
with an unrestricted ``torch.load``; Rewind hands DCP tensors only and keeps
the rest of the tree in JSON (``state.json``). DCP's own ``.metadata`` is still a
pickle. Restore goes through the one restore path (:mod:`infra.restore`) on rank
0: the copy is held to the manifest digest the catalog recorded (a remote copy is
fetched first); then every rank loads through :class:`infra.format.dcp.VerifiedReader`,
which reads each file whole, hashes it against the manifest, and only then hands
DCP the bytes, ``.metadata`` unpickled by an unpickler that admits DCP's own
metadata classes and nothing else. The verdict of every rank goes back to rank 0,
which records it against the copy and, if need be, tries the next one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from infra.catalog import leases, lineage
from infra.catalog.db import Catalog
from infra.checkpoint.recording import recorded_save
from infra.checkpoint.state import environment, writer
from infra.errors import (
    ConfigError,
    CorruptCheckpoint,
    NoRestorableCheckpoint,
    RankFailed,
    RunBusy,
    UnloadableCheckpoint,
)
from infra.faults import fault_point
from infra.format import dcp as verified_dcp
from infra.format import manifest as mf
from infra.format import payload, store, tree
from infra.format.digest import hash_file
from infra.format.verify import Finding, Problem
from infra.restore import execute as restore_exec
from infra.restore import plan as restore_plan
from infra.restore.execute import Skip

RANK_STATE = "rank-{rank}.json"
StateTree = dict[str, Any] | Callable[[], dict[str, Any]]
SHARED_STATE = "state.json"


def _json_writer(obj: Any) -> store.FileWriter:
    def fill(out: BinaryIO) -> None:
        out.write(json.dumps(obj).encode())

    return fill


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
    parent: tuple[int, str | None] | None = None,
) -> tuple[Path, str]:
    """Collective: every rank calls it. Returns the committed directory and its manifest digest, on every rank.

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
            raise ConfigError("per-rank state must not hold tensors; put them in the sharded state")
        entries.append(store.write_file(tmp / _rank_state_file(rank), _json_writer(json_tree)))
        fault_point("save.shard_written", step)  # this rank's files are down, none committed yet
        if rank == 0:
            entries.append(store.write_file(tmp / SHARED_STATE, _json_writer(shared_tree)))
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
                raise RankFailed("; ".join(errors))
            files = [e for _, es in gathered for e in es]
            d = hash_file(tmp / ".metadata")
            files.append(mf.FileEntry(".metadata", d.size, d.xxh3, d.crc32c))
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
            outcome[0] = ("ok", store.commit(tmp, manifest).digest)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome[0] = ("error", str(exc))
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise RankFailed(f"sharded save of step {step} failed: {value}")
    return final, value


def _unwrap(directory: Path, exc: BaseException) -> BaseException:
    """DCP gathers every rank's failure into one CheckpointException: the most telling one, as Rewind's."""
    failures = [e for e, _trace in getattr(exc, "failures", {}).values()] or [exc]
    corrupt = [
        e for e in failures if isinstance(e, CorruptCheckpoint) and not isinstance(e, UnloadableCheckpoint)
    ]
    if corrupt:
        return CorruptCheckpoint(str(directory), [f for e in corrupt for f in e.findings])
    for kind in (UnloadableCheckpoint, OSError):
        found = [e for e in failures if isinstance(e, kind)]
        if found:
            return found[0]
    return failures[0]


def load(
    directory: Path, manifest: mf.Manifest, state: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: load a copy whose manifest matched the catalog into ``state``'s tensors, in place.

    Every file is verified as it is read (``VerifiedReader``). Returns (the saved tree
    with the loaded tensors, this rank's own state); a rank that did not exist when
    the checkpoint was saved gets rank 0's state.
    """
    entries = {e.path: e for e in manifest.files}
    if payload.DCP_METADATA not in entries:  # the caller's mistake, not the checkpoint's: condemn nothing
        raise ConfigError(f"{directory} is not a sharded (DCP) checkpoint: load it with Checkpointer")
    _, tensors = tree.split(state, "s")  # the same names as at save time: where to load into
    try:
        verified_dcp.load(tensors, directory, entries)
    except BaseException as exc:  # CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise _unwrap(directory, exc) from exc
    own = _rank_state_file(dist.get_rank())
    own = own if own in entries else _rank_state_file(0)
    for needed in (SHARED_STATE, own):
        if needed not in entries:
            raise UnloadableCheckpoint(
                str(directory), [Finding(Problem.CONTENT, needed, "not in the manifest")]
            )
    try:
        restored = tree.join(payload.read_json(directory, entries[SHARED_STATE]), tensors)
        mine = tree.join(payload.read_json(directory, entries[own]), {})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UnloadableCheckpoint(
            str(directory), [Finding(Problem.CONTENT, SHARED_STATE, str(exc))]
        ) from exc
    return restored, mine


def layout_of(world: int) -> dict[str, int]:
    return {"world_size": world, "tp": 1, "pp": 1, "dp": world}


class ShardedCheckpointer:
    """The multi-rank counterpart of ``Checkpointer``: every rank calls every method.

    Rank 0 alone talks to the catalog and runs the restore plan; the others follow
    its broadcasts, so all ranks always load the same checkpoint.
    """

    def __init__(self, run: str, *, root: Path, catalog: Any = None) -> None:
        self.run = run
        self.root = Path(root).expanduser().resolve()
        self.run_dir = self.root / run
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.catalog = (catalog or Catalog()) if self.rank == 0 else None
        # Rank 0 leads: it alone holds the catalog and the run's id.
        self._lead = (
            (self.catalog, lineage.ensure_run(self.catalog, run)) if self.catalog is not None else None
        )
        refused = ""
        if self._lead is not None:
            try:
                leases.take_writer(*self._lead)
            except RunBusy as exc:
                refused = str(exc)
        box: list[Any] = [refused]
        dist.broadcast_object_list(box, src=0)  # every rank learns it: none goes on alone
        if box[0]:
            raise RunBusy(box[0])
        self._parent_id: int | None = None
        self._parent: tuple[int, str | None] | None = None  # rank 0: (step, manifest digest) of the parent
        self.skipped: tuple[Skip, ...] = ()  # rank 0: what the last restore passed over, and why
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
        layout = layout_of(self.world)
        if self._lead is None:
            save(self.run_dir, self.run, step, state, rank_state, layout=layout, metrics=metrics)
        else:
            cat, run_id = self._lead
            env = environment()
            with recorded_save(
                cat, run_id, self.run_dir, step, parent_id=self._parent_id, layout=layout, environment=env
            ) as (ck_id, _):
                final, digest = save(
                    self.run_dir,
                    self.run,
                    step,
                    state,
                    rank_state,
                    layout=layout,
                    metrics=metrics,
                    parent=self._parent,
                )
                lineage.commit(cat, ck_id, mf.read(final), digest=digest, stall_s=None, uri=str(final))
                leases.touch_writer(cat, run_id)
                self._parent_id, self._parent = ck_id, (step, digest)
        dist.barrier()  # no rank goes on before the checkpoint is committed

    def close(self) -> None:
        """Let another process write this run (rank 0 holds the writer lease)."""
        if self._lead is not None:
            leases.release_writer(*self._lead)

    def restore_latest(self, state: StateTree) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """(step, restored tree, this rank's state) of the newest checkpoint that proves itself, or None.

        ``state`` is the tree to load into, or a function that builds it: called (on every
        rank at once) only when there is a checkpoint to load, so a fresh run never pays
        for it (asking an optimizer for its state dict initialises its state).
        """
        if self.rank == 0:
            return self._lead_restore(state)
        return self._follow_restore(state)

    def _attempt(self, directory: Path, manifest: mf.Manifest, state: StateTree) -> Any:
        """One collective try: every rank loads, every verdict is gathered; rank 0 raises the worst."""
        mine: Any = None
        error: BaseException | None = None
        try:
            mine = load(directory, manifest, state() if callable(state) else state)
        except Exception as exc:  # every rank must reach the gather below, whatever went wrong
            error = exc
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, error)
        failed = [e for e in errors if e is not None]
        if failed and self.rank == 0:
            raise _unwrap(directory, CheckpointFailures(failed))
        return mine if not failed else None

    def _lead_restore(self, state: StateTree) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        tried: list[int] = []

        def load_everywhere(directory: Path, manifest: mf.Manifest) -> Any:
            tried.append(manifest.step)
            dist.broadcast_object_list([("try", str(directory), manifest)], src=0)
            return self._attempt(directory, manifest, state)

        if self._lead is None:
            raise ConfigError("only rank 0 leads a restore")
        cat = self._lead[0]
        p = restore_plan.plan(cat, self.run, root=self.root)
        try:
            done = restore_exec.execute(cat, p, load_everywhere)
        except NoRestorableCheckpoint as exc:
            self.skipped = exc.skipped
            if tried:  # DCP loads in place: a failed attempt leaves the state partly loaded
                why = f"{exc}; the state was partly loaded from step {tried[-1]}: start the job again to begin anew"
                dist.broadcast_object_list([("error", why, None)], src=0)
                raise NoRestorableCheckpoint(why, exc.skipped) from exc
            dist.broadcast_object_list([("none", None, None)], src=0)
            return None
        except BaseException as exc:
            dist.broadcast_object_list([("error", f"{type(exc).__name__}: {exc}", None)], src=0)
            raise
        dist.broadcast_object_list([("done", done.step, None)], src=0)
        self._parent_id, self.skipped = done.checkpoint_id, done.skipped
        self._parent = (done.step, lineage.get_checkpoint(cat, done.checkpoint_id).manifest_digest)
        restored, mine = done.value
        return done.step, restored, mine

    def _follow_restore(self, state: StateTree) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        last: Any = None
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            kind, value, manifest = box[0]
            if kind == "try":
                last = self._attempt(Path(value), manifest, state)
            elif kind == "done":
                restored, mine = last
                return int(value), restored, mine
            elif kind == "none":
                return None
            else:
                raise RankFailed(f"restore failed on rank 0: {value}")


class CheckpointFailures(Exception):
    """Failures gathered from every rank, shaped like DCP's CheckpointException for :func:`_unwrap`."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__(f"{len(errors)} rank(s) failed")
        self.failures = {i: (e, None) for i, e in enumerate(errors)}
