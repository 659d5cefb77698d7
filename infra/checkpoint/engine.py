"""The checkpointer a training script holds: save, and restore the newest good state.

Usage::

    ckpt = Checkpointer("my-run", states={"model": model, "optimizer": opt, "lr_scheduler": sched,
                                           "data": loader, "rng": RNGState(), "extras": extras})
    start = ckpt.restore_latest()          # None on a fresh run
    ...
    ckpt.save(step, metrics={"loss": loss})

Restore goes through the one restore path (:mod:`rewind.infra.restore`): the run's
checkpoints newest first, each copy nearest first, every byte proven against the
manifest digest the catalog recorded before anything is loaded; what fails is
recorded against the copy (saying which file and why) and the next copy, then the
previous checkpoint, is tried.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from rewind.infra import config, progress, throttle
from rewind.infra.catalog import commits, leases, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus
from rewind.infra.catalog.writer_lease import WriterLease
from rewind.infra.checkpoint import displaced, stall_hash
from rewind.infra.checkpoint import priority as persist_priority
from rewind.infra.checkpoint.background import BackgroundRunner
from rewind.infra.checkpoint.load_parts import PartLoader
from rewind.infra.checkpoint.recording import recorded_save
from rewind.infra.checkpoint.staging import Staged, StagingBuffer
from rewind.infra.checkpoint.state import Stateful, as_stateful, environment, writer
from rewind.infra.errors import ConfigError, NoRestorableCheckpoint
from rewind.infra.faults import fault_point
from rewind.infra.format import chunked, direct, payload, pids, store, tree
from rewind.infra.format import manifest as mf
from rewind.infra.restore import execute as restore_exec
from rewind.infra.restore import plan as restore_plan
from rewind.infra.restore.execute import Skip

log = logging.getLogger("rewind.checkpoint")
S = CheckpointStatus


class SaveMode(StrEnum):
    SYNC = "sync"  # save() returns when the checkpoint is committed
    ASYNC = "async"  # save() returns once the state is staged in CPU memory


@dataclass(frozen=True, slots=True)
class RestoreResult:
    step: int
    checkpoint_id: int
    path: str
    load_s: float
    skipped: tuple[Skip, ...] = ()
    bytes_read: int = 0  # hashed (and fetched) to restore it: each byte of the restore point once
    source: str = "local"  # the tier of the copy read (memory, local), or the one it was fetched from
    fetched: bool = False


@dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    checkpoint_id: int
    path: str
    total_bytes: int
    stall_s: float
    manifest_digest: str
    written_bytes: int = 0  # bytes this save wrote (data files and manifest)
    linked_bytes: int = 0  # bytes hard-linked from an earlier checkpoint instead (chunked format)


@dataclass
class Checkpointer:
    """Saves and restores the full training state of one run."""

    run: str
    states: Mapping[str, Any]
    root: Path = field(default_factory=config.checkpoint_root)
    catalog: Catalog | None = None
    layout: dict[str, int] = field(default_factory=lambda: {"world_size": 1, "tp": 1, "pp": 1, "dp": 1})
    mode: SaveMode = SaveMode.SYNC
    exit_timeout_s: float = 300.0
    format: str = payload.PLAIN  # or payload.CHUNKED: unchanged chunks are linked, not written

    def __post_init__(self) -> None:
        if not self.states:
            raise ConfigError("Checkpointer needs at least one state to capture")
        payload.check_format(self.format)
        throttle.for_writes()  # a bad REWIND_WRITE_LIMIT fails here, not in the first background save
        priority = persist_priority.configured()  # and a bad REWIND_PERSIST_PRIORITY
        stall_hash.configured()  # and a bad REWIND_HASH_IN_STALL
        direct.wanted()  # a bad REWIND_DIRECT_WRITES too, before anything is written
        for name in self.states:
            mf.safe_relative(payload.tensor_file(name))
            if name.endswith(".json") or name == "manifest":
                raise ConfigError(f"state name {name!r} is reserved")
        self._stateful: dict[str, Stateful] = {k: as_stateful(k, v) for k, v in self.states.items()}
        self._load = PartLoader(self._stateful)  # the restore path's loader
        self._cat: Catalog = self.catalog or Catalog()
        self.catalog = self._cat
        self.root = Path(self.root).expanduser().resolve()
        self.run_dir = self.root / self.run
        self.run_id = lineage.ensure_run(self._cat, self.run)
        self.mode = SaveMode(self.mode)
        self._lease = WriterLease(self._cat, self.run_id)
        self._lease.take()  # a second live writer is refused here, by name
        try:
            self._parent_id: int | None = None
            self._parent_step: int | None = None
            self._parent_digest: str | None = None
            self._staging = StagingBuffer()
            self._runner = BackgroundRunner(f"rewind-{self.run}", self.exit_timeout_s, priority=priority)
            self.last_saved: SaveResult | None = None  # the newest committed save of this process
            self.skipped: tuple[Skip, ...] = ()  # what the last restore passed over, and why
            self._recover_leftovers()
        except BaseException:
            self._lease.release()  # never held past a construction that failed
            raise

    # -- save -----------------------------------------------------------------

    def save(self, step: int, *, metrics: Mapping[str, float] | None = None) -> float:
        """Checkpoint the current state; returns the seconds the caller was blocked.

        Synchronous mode returns once the checkpoint is committed. Asynchronous mode
        returns once the tensors are copied to the staging buffer; the rest happens
        in the background, and a failure there is raised by the next call.
        """
        started = time.perf_counter()
        if self.mode is SaveMode.ASYNC:
            self._runner.wait()  # back-pressure: one save in flight, one staging copy
        trees, tensors = payload.split_states({k: s.state_dict() for k, s in self._stateful.items()})
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        if self.mode is SaveMode.SYNC:
            self._persist(step, trees, Staged(dict(tensors)), metrics, started)
            return time.perf_counter() - started
        staged, prehashed = self._stage(tensors)
        stall = time.perf_counter() - started
        self._runner.submit(
            f"save of step {step}", lambda: self._persist(step, trees, staged, metrics, stall, prehashed)
        )
        return stall

    def _stage(self, tensors: dict[str, dict[str, torch.Tensor]]) -> tuple[Staged, payload.Prehashed]:
        """The state staged; and where the job leaves no core to the background persist, its digests."""
        return stall_hash.stage(self._staging, tensors, fmt=self.format, all_new=self._all_new())

    def _all_new(self) -> bool:
        """Whether a chunked save is expected to write most of its chunks anew: the first of this process,
        or one after a save that wrote at least half its bytes (``stage_chunked`` hashes its packs ahead)."""
        last = self.last_saved
        return last is None or 2 * last.written_bytes >= last.total_bytes

    def prepare(self) -> None:
        """Async mode: the staging buffer for the state as it is now, allocated and made resident in the
        background, so that the first save stalls for a copy, like every later one, not for the buffer's
        allocation too (1.04 s for 1.07 GB here, 0.10 s prepared). The buffer (one copy of the state) is
        held from then on, as after a first save. Call it once the state has the shapes it is saved with:
        after the first optimizer step, or after a restore (``TrainingSession`` does). A save waits for it.
        Never fails the job: while a save is in flight, or its failure is still to be raised by the next
        ``save``, it does nothing; the first save allocates the buffer then."""
        if self.mode is not SaveMode.ASYNC or not self._runner.idle:
            return
        try:
            _, tensors = payload.split_states({k: s.state_dict() for k, s in self._stateful.items()})
        except Exception as exc:  # the save that needs it says why, where it is the job's to hear
            log.warning("staging buffer not prepared: %s", exc)
            return
        self._runner.submit("staging buffer", lambda: self._prepare(tensors))

    def _prepare(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        try:
            self._staging.prepare(tensors)
        except Exception as exc:  # never raised by a save (on one rank alone): the first save allocates
            log.warning("staging buffer not prepared: %s", exc)

    def wait(self) -> None:
        """Block until an in-flight background save is committed; raise if it failed."""
        self._runner.wait()

    def close(self) -> None:
        """Wait for an in-flight save, then let another process write this run."""
        self._runner.close()
        self._lease.release()

    def _persist(
        self,
        step: int,
        trees: dict[str, Any],
        staged: Staged,
        metrics: dict[str, float],
        stall: float,
        prehashed: payload.Prehashed | None = None,
    ) -> SaveResult:
        """Write, fsync, manifest, rename, then catalog commit. ``stall`` is a start time in sync mode."""
        env = environment()
        with recorded_save(
            self._cat,
            self.run_id,
            self.run_dir,
            step,
            parent_id=self._parent_id,
            layout=self.layout,
            environment=env,
            writer=leases.writer_name(),
        ) as (ck_id, final, displace):
            staged.ready()
            done = store.write_checkpoint(
                self.run_dir, self._draft(step, env, metrics, trees), self._files(trees, staged, prehashed),
                displace=displace, streams=store.WRITE_STREAMS,
            )  # fmt: skip
            manifest = done.manifest
            fault_point("save.before_catalog", step)
            if self.mode is SaveMode.SYNC:
                stall = time.perf_counter() - stall
            commits.commit(
                self._cat, ck_id, manifest, digest=done.digest, stall_s=stall, uri=str(final),
                writer=leases.writer_name(),
            )  # fmt: skip
            self._lease.touch()
        self._parent_id, self._parent_step, self._parent_digest = ck_id, step, done.digest
        result = SaveResult(
            step,
            ck_id,
            str(final),
            manifest.total_bytes,
            stall,
            done.digest,
            done.written_bytes,
            done.linked_bytes,
        )
        self.last_saved = result
        log.info(
            "checkpoint step %d committed: %s (%d bytes, %d written, stall %.3fs)",
            step,
            final,
            manifest.total_bytes,
            done.written_bytes,
            stall,
        )
        return result

    def _draft(
        self, step: int, env: dict[str, str], metrics: dict[str, float], trees: dict[str, Any]
    ) -> mf.Manifest:
        """The manifest of a save of ``step`` (its states' JSON ``trees``), all but its files."""
        return mf.Manifest(
            run=self.run,
            step=step,
            files=(),
            parent_step=self._parent_step,
            parent_digest=self._parent_digest,
            writer=writer("rewind.Checkpointer"),
            created_at=datetime.now(UTC).isoformat(),
            layout=self.layout,
            environment=env,
            metrics=metrics,
            layouts=tree.gives_layouts(trees),
        )

    def _files(
        self, trees: dict[str, Any], staged: Staged, prehashed: payload.Prehashed | None
    ) -> list[tuple[str, store.FileWriter | store.Link | store.Hashed]]:
        """The save's files from ``staged``; those hashed already (``prehashed``, or now by
        ``stall_hash.behind``) written as hashed."""
        prehashed = stall_hash.behind(staged.parts, prehashed, fmt=self.format, all_new=self._all_new())
        return payload.file_writers(
            trees, staged.parts, fmt=self.format, link_from=self._link_source(), prehashed=prehashed
        )

    def _link_source(self) -> chunked.Parent | None:
        """What a chunked save links packs from: this process's last checkpoint, else the newest on disk.

        Either way only one whose manifest is the catalog's record of it (the format checks).
        """
        if self.format != payload.CHUNKED:
            return None
        if self._parent_step is not None and self._parent_digest:
            parent = store.step_dir(self.run_dir, self._parent_step)
            if (parent / mf.MANIFEST_NAME).is_file():
                return chunked.Parent(parent, self._parent_digest)
        newest = store.newest_committed(self.run_dir)
        if newest is None:
            return None
        step = int(newest.name.removeprefix("step-"))
        recorded = [c.manifest_digest for c in lineage.restorable(self._cat, self.run_id) if c.step == step]
        return chunked.Parent(newest, recorded[0]) if recorded and recorded[0] else None

    # -- restore --------------------------------------------------------------

    def restore_latest(self, *, target: restore_plan.RestoreTarget | None = None) -> RestoreResult | None:
        """Load the newest checkpoint that proves itself; None when the run has none that could.

        ``target``: the restore point a recovery chose (its checkpoint, else an older one; none that
        proves itself is ``NoRestorableCheckpoint``, never a fresh start). Every
        byte is hashed once, as it is read (``RestoreResult.bytes_read``). Refuses to start over
        (``CheckpointUnverifiable``) while a checkpoint exists that could not be checked right
        now: an I/O error or an unknown key is not a reason to throw a run's progress away.
        """
        self._runner.wait()
        p = restore_plan.plan(self._cat, self.run, root=self.root, target=target)
        try:
            with progress.tallied() as read:
                done = restore_exec.execute(self._cat, p, self._load)
        except NoRestorableCheckpoint as exc:
            self.skipped = exc.skipped
            if target is not None:  # a recovery chose a restore point: starting over would lose the run
                raise
            if self._load.part_loaded:  # never a fresh start from a model that holds part of a checkpoint
                raise NoRestorableCheckpoint(
                    f"{exc}; a load wrote into a module's own tensors before it failed: not starting from "
                    "scratch with them (start a new process to start over)",
                    exc.skipped,
                ) from exc
            if p.candidates:
                log.warning("%s; starting from scratch", exc)
            return None
        self.skipped = done.skipped
        self._parent_id, self._parent_step = done.checkpoint_id, done.step
        self._parent_digest = lineage.get_checkpoint(self._cat, done.checkpoint_id).manifest_digest
        result = RestoreResult(
            done.step, done.checkpoint_id, str(done.directory), done.seconds, done.skipped, read.bytes,
            done.source, done.fetched,
        )  # fmt: skip
        log.info(
            "restored step %d from the %s copy %s in %.3fs",
            done.step,
            done.source,
            done.directory,
            done.seconds,
        )
        return result

    # -- start-up hygiene -------------------------------------------------------

    def _recover_leftovers(self) -> None:
        """Sweep temp directories of dead writers and settle rows they left in 'writing'."""
        for p in store.sweep_temp(self.run_dir):
            log.info("swept unfinished save %s", p)
        host = socket.gethostname()
        for ck in lineage.writing(self._cat, self.run_id):
            env = ck.environment or {}
            pid = int(env.get("pid", 0))
            if env.get("hostname") != host or (pid != os.getpid() and pids.alive(pid)):
                continue
            # The writer died. If it got as far as the rename, the directory is complete but uncommitted:
            # treat it as not existing and remove it; if not, what lies there is the step's committed one.
            final = Path(ck.path)
            if final.exists() and not displaced.held_by_live(self._cat, self.run_id, ck.step, final):
                displaced.move_out(self._cat, final, "a save whose writer died before commit")
            lineage.transition(self._cat, ck.id, (S.WRITING,), S.ABORTED, "writer died before commit")
            log.info("checkpoint step %d was never committed (writer died); discarded", ck.step)
        displaced.put_back_all(self._cat, self.run_id, self.run_dir)  # what a save that failed moved aside
