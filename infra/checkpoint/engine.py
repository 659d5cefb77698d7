"""The checkpointer a training script holds: save, and restore the newest good state.

Usage::

    ckpt = Checkpointer("my-run", states={"model": model, "optimizer": opt, "lr_scheduler": sched,
                                           "data": loader, "rng": RNGState(), "extras": extras})
    start = ckpt.restore_latest()          # None on a fresh run
    ...
    ckpt.save(step, metrics={"loss": loss})

Restore walks the run's committed checkpoints newest first, proves every byte
against the manifest before anything is loaded, marks what fails as corrupt
(saying which file and why) and falls back to the previous one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from infra import config
from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import Checkpoint, CheckpointStatus
from infra.checkpoint import manifest as mf
from infra.checkpoint import payload, store
from infra.checkpoint.audit import manifest_matches_catalog, record_corrupt
from infra.checkpoint.background import BackgroundRunner
from infra.checkpoint.staging import Staged, StagingBuffer
from infra.checkpoint.state import Stateful, as_stateful, environment
from infra.checkpoint.verify import Finding, Problem
from infra.errors import ConfigError, CorruptCheckpoint, RewindError
from infra.faults import fault_point
from infra.tiers import catalogued

log = logging.getLogger("rewind.checkpoint")
S = CheckpointStatus


class SaveMode(StrEnum):
    SYNC = "sync"  # save() returns when the checkpoint is committed
    ASYNC = "async"  # save() returns once the state is staged in CPU memory


@dataclass(frozen=True, slots=True)
class Skipped:
    step: int
    checkpoint_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class RestoreResult:
    step: int
    checkpoint_id: int
    path: str
    load_s: float
    skipped: tuple[Skipped, ...] = ()


@dataclass(frozen=True, slots=True)
class SaveResult:
    step: int
    checkpoint_id: int
    path: str
    total_bytes: int
    stall_s: float
    manifest_digest: str


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

    def __post_init__(self) -> None:
        if not self.states:
            raise ConfigError("Checkpointer needs at least one state to capture")
        for name in self.states:
            mf.safe_relative(f"{name}.safetensors")
            if name.endswith(".json") or name == "manifest":
                raise ConfigError(f"state name {name!r} is reserved")
        self._stateful: dict[str, Stateful] = {k: as_stateful(k, v) for k, v in self.states.items()}
        self.catalog = self.catalog or Catalog()
        self.root = Path(self.root).expanduser().resolve()
        self.run_dir = self.root / self.run
        self.run_id = lineage.ensure_run(self.catalog, self.run)
        self._parent_id: int | None = None
        self._parent_step: int | None = None
        self.mode = SaveMode(self.mode)
        self._staging = StagingBuffer()
        self._runner = BackgroundRunner(f"rewind-{self.run}", self.exit_timeout_s)
        self.last_saved: SaveResult | None = None  # the newest committed save of this process
        self.skipped: tuple[Skipped, ...] = ()  # what the last restore passed over, and why
        self._recover_leftovers()

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
        staged = self._staging.stage(tensors)
        stall = time.perf_counter() - started
        self._runner.submit(
            f"save of step {step}", lambda: self._persist(step, trees, staged, metrics, stall)
        )
        return stall

    def wait(self) -> None:
        """Block until an in-flight background save is committed; raise if it failed."""
        self._runner.wait()

    def close(self) -> None:
        self._runner.close()

    def _persist(
        self, step: int, trees: dict[str, Any], staged: Staged, metrics: dict[str, float], stall: float
    ) -> SaveResult:
        """Write, fsync, manifest, rename, then catalog commit. ``stall`` is a start time in sync mode."""
        env = environment()
        with recorded_save(
            self.catalog,
            self.run_id,
            self.run_dir,
            step,
            parent_id=self._parent_id,
            layout=self.layout,
            environment=env,
        ) as (ck_id, final):
            draft = mf.Manifest(
                run=self.run,
                step=step,
                files=(),
                parent_step=self._parent_step,
                created_at=datetime.now(UTC).isoformat(),
                layout=self.layout,
                environment=env,
                metrics=metrics,
            )
            staged.ready()
            _, manifest = store.write_checkpoint(
                self.run_dir, draft, payload.file_writers(trees, staged.parts)
            )
            fault_point("save.before_catalog", step)
            if self.mode is SaveMode.SYNC:
                stall = time.perf_counter() - stall
            lineage.commit(self.catalog, ck_id, manifest, stall_s=stall, uri=str(final))
        self._parent_id, self._parent_step = ck_id, step
        result = SaveResult(step, ck_id, str(final), manifest.total_bytes, stall, manifest.digest())
        self.last_saved = result
        log.info(
            "checkpoint step %d committed: %s (%d bytes, stall %.3fs)",
            step,
            final,
            manifest.total_bytes,
            stall,
        )
        return result

    # -- restore --------------------------------------------------------------

    def restore_latest(self) -> RestoreResult | None:
        """Load the newest checkpoint that verifies; None when the run has none."""
        self._runner.wait()
        skipped: list[Skipped] = []
        for ck in lineage.restorable(self.catalog, self.run_id):
            started = time.perf_counter()
            try:
                states = self._read_nearest(ck)
            except CorruptCheckpoint as exc:
                record_corrupt(self.catalog, ck, exc.findings)
                reason = "; ".join(str(f) for f in exc.findings)
                skipped.append(Skipped(ck.step, ck.id, reason))
                log.warning("skipping checkpoint step %d (%s): %s", ck.step, ck.path, reason)
                continue
            self._apply(states)
            lineage.transition(self.catalog, ck.id, (S.COMMITTED,), S.VERIFIED)
            self._parent_id, self._parent_step = ck.id, ck.step
            self.skipped = tuple(skipped)
            result = RestoreResult(ck.step, ck.id, ck.path, time.perf_counter() - started, self.skipped)
            log.info("restored step %d from %s in %.3fs", ck.step, ck.path, result.load_s)
            return result
        if skipped:
            log.warning("no checkpoint of run %r verifies; starting from scratch", self.run)
        self.skipped = tuple(skipped)
        return None

    def _read_nearest(self, ck: Checkpoint) -> dict[str, Any]:
        """The local copy if it verifies, else the nearest verified replica, downloaded and verified."""
        try:
            return self._read_verified(ck)
        except CorruptCheckpoint as local:
            for rep in catalogued.remote_replicas(self.catalog, ck.id):
                try:
                    catalogued.restore_to_local(self.catalog, ck, rep, self.root)
                    return self._read_verified(lineage.get_checkpoint(self.catalog, ck.id))
                except (RewindError, OSError) as exc:
                    log.warning("step %d: %s copy at %s unusable: %s", ck.step, rep.tier, rep.uri, exc)
            raise local

    def _read_verified(self, ck: Checkpoint) -> dict[str, Any]:
        directory = Path(ck.path)
        try:
            manifest = mf.read(directory)
        except mf.ManifestError as exc:
            raise CorruptCheckpoint(ck.path, [Finding(Problem.MANIFEST, mf.MANIFEST_NAME, str(exc))]) from exc
        wrong = manifest_matches_catalog(directory, ck)
        if wrong is None and (manifest.run, manifest.step) != (self.run, ck.step):
            wrong = Finding(Problem.MANIFEST, mf.MANIFEST_NAME, f"names {manifest.run}@{manifest.step}")
        if wrong is not None:
            raise CorruptCheckpoint(ck.path, [wrong])
        states = payload.read_states(directory, manifest)
        missing = set(self._stateful) - set(states)
        if missing:
            raise ConfigError(
                f"checkpoint {ck.path} has no state for {sorted(missing)}; it was written by another job"
            )
        return states

    def _apply(self, states: Mapping[str, Any]) -> None:
        for name, stateful in self._stateful.items():
            stateful.load_state_dict(states[name])

    # -- start-up hygiene -------------------------------------------------------

    def _recover_leftovers(self) -> None:
        """Sweep temp directories of dead writers and settle rows they left in 'writing'."""
        for p in store.sweep_temp(self.run_dir):
            log.info("swept unfinished save %s", p)
        host = socket.gethostname()
        for ck in lineage.writing(self.catalog, self.run_id):
            env = ck.environment or {}
            pid = int(env.get("pid", 0))
            if env.get("hostname") != host or (pid != os.getpid() and store.pid_alive(pid)):
                continue
            # The writer died. If it got as far as the rename, the directory is
            # complete but uncommitted: treat it as not existing and remove it.
            final = Path(ck.path)
            if final.exists():
                store.quarantine(final, "uncommitted")
            lineage.transition(self.catalog, ck.id, (S.WRITING,), S.ABORTED, "writer died before commit")
            log.info("checkpoint step %d was never committed (writer died); discarded", ck.step)


@contextlib.contextmanager
def recorded_save(
    cat: Catalog,
    run_id: int,
    run_dir: Path,
    step: int,
    *,
    parent_id: int | None,
    layout: dict,
    environment: dict,
) -> Iterator[tuple[int, Path]]:
    """The catalog side of one save: a ``writing`` row for the body to commit, ``aborted`` if it raises.

    A live checkpoint already at this step is superseded first (a replayed timeline).
    """
    old = lineage.live_at(cat, run_id, step)
    final = store.step_dir(run_dir, step)
    if old is not None:
        lineage.transition(
            cat,
            old.id,
            (S.WRITING, S.COMMITTED, S.VERIFIED),
            S.ABORTED if old.status == S.WRITING else S.SUPERSEDED,
            f"superseded by a new save at step {step}",
        )
    if final.exists():
        moved = store.quarantine(final, "superseded")
        if old is not None:
            lineage.set_path(cat, old.id, str(moved))
    ck_id = lineage.begin(
        cat, run_id, step, str(final), parent_id=parent_id, layout=layout, environment=environment
    )
    try:
        yield ck_id, final
    except BaseException as exc:
        lineage.transition(cat, ck_id, (S.WRITING,), S.ABORTED, f"save failed: {exc}"[:2000])
        raise
