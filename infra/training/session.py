"""The training side of Rewind for any PyTorch job: one object around the training loop.

    with TrainingSession("my-run", model=model, optimizer=opt, states={"sched": sched},
                         loader=loader, checkpoint_every=100) as s:
        lr = base_lr * s.handoff.lr_scale          # what the supervisor decided after a rebuild
        for step in s.steps(total_steps):
            loss = train_step(next(batches))
            s.report(step, loss)                   # progress, NaN/spike check, checkpoint when due

On entering, the newest checkpoint that proves itself is restored (single process:
``Checkpointer``; under torchrun: ``ShardedCheckpointer``, resharded to this world
size) and a data window the supervisor wants skipped is stepped over by the
loader. Progress goes to the supervisor through the catalog
(``rewind.infra.training.progress``), not stdout. A NaN/Inf loss (or a spike, with
``spike_factor``) is recorded and raised as ``TrainingAnomaly``, so the job
stops and the supervisor rolls it back. No Prefect here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from rewind.infra import config, progress
from rewind.infra.catalog import models
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import assemble
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.checkpoint.sharded import ShardedCheckpointer, per_rank_part
from rewind.infra.checkpoint.state import RNGState
from rewind.infra.errors import ConfigError, RewindError, is_transient
from rewind.infra.format import payload
from rewind.infra.health.layout import Layout, ModelShape
from rewind.infra.health.signals import LossWatch
from rewind.infra.training import after_restore, comeback, group, restart
from rewind.infra.training import parts as job_parts
from rewind.infra.training.after_restore import position_of
from rewind.infra.training.data import SkippableLoader, StatefulLoader
from rewind.infra.training.handoff import Handoff
from rewind.infra.training.progress import LAUNCH_ENV, ProgressWriter

log = logging.getLogger("rewind.session")


class TrainingAnomaly(RewindError):
    """The loss went NaN/Inf or spiked: recorded for the supervisor, which rolls the run back."""


class TrainingSession:
    """Restore on entry, report and checkpoint inside, record how it ended on exit. Keyword-only options."""

    def __init__(
        self,
        run: str,
        *,
        model: Any = None,
        optimizer: Any = None,
        states: Mapping[str, Any] | None = None,
        loader: SkippableLoader | StatefulLoader | None = None,
        checkpoint_every: int = 0,
        mode: SaveMode = SaveMode.SYNC,
        format: str = payload.PLAIN,
        spike_factor: float | None = None,
        heartbeat_s: float = 1.0,
        root: Path | None = None,
        catalog: Catalog | None = None,
        layout: Layout | None = None,
        model_shape: ModelShape | None = None,
    ) -> None:
        if checkpoint_every < 0:
            raise ConfigError("checkpoint_every cannot be negative")
        self.run, self.loader, self.checkpoint_every, self.mode = (
            run,
            loader,
            checkpoint_every,
            SaveMode(mode),
        )
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        # under torchrun a loader without a global position (torchdata's StatefulDataLoader) keeps its state
        # per rank: restored on the same world size only, and a rebuild keeps the world size for it
        self.per_rank_data = self.distributed and loader is not None and not hasattr(loader, "skip_to")
        if self.per_rank_data and not hasattr(loader, "state_dict"):
            raise ConfigError(
                f"{type(loader).__name__} has neither a global position (skip_to) nor a state_dict(): under "
                "torchrun give the session a ResumableLoader, a StatefulDataLoader, or checkpoint it yourself"
            )
        self.format = payload.check_format(format)
        self.root = Path(root or config.checkpoint_root())
        self.catalog: Catalog | None = catalog or self._open_catalog()
        self.parts = self._parts(model, optimizer, dict(states or {}))
        self.layout, self.model_shape = layout, model_shape or job_parts.shape_of(model)
        self.spike_factor = spike_factor
        self.watch = LossWatch(spike_factor=float("inf"))
        self.heartbeat_s = heartbeat_s
        self.handoff = Handoff()
        self.start_step = 0
        self.restored_from: str | None = None  # the checkpoint directory restored (single process)
        self.restored_checkpoint_id: int | None = None  # the checkpoint restored (rank 0 when distributed)
        self.skipped: tuple[Any, ...] = ()  # what the restore passed over, and why (rank 0)
        self.read_from: dict[str, Any] = {}  # where the restore's bytes came from (rank 0, distributed)
        self._writer: ProgressWriter | None = None
        self._ckpt: Checkpointer | ShardedCheckpointer | None = None
        self.last_step: int | None = None  # the newest step reported
        self._restarts: list[dict[str, Any]] = []
        self._prepared = False  # the async staging memory asked for (``_prepare``)

    def _open_catalog(self) -> Catalog | None:
        """Rank 0 opens (and if need be creates) the catalog first; other ranks need it only under a supervisor."""
        if not self.distributed:
            return Catalog()
        first = Catalog() if self.rank == 0 else None
        dist.barrier()  # the schema exists before any other rank connects
        return first if self.rank == 0 else (Catalog() if os.environ.get(LAUNCH_ENV) else None)

    def _parts(self, model: Any, optimizer: Any, states: dict[str, Any]) -> dict[str, Any]:
        """Model and optimizer go through DCP's state-dict API when distributed (DDP/FSDP-aware)."""
        if "rng" in states:
            raise ConfigError("'rng' is the session's own state (every generator, per rank)")
        parts: dict[str, Any] = {}
        if model is not None:
            parts["model"] = job_parts.ModelPart(model) if self.distributed else model
        if optimizer is not None:
            if model is None:
                raise ConfigError("an optimizer needs its model")
            parts["optimizer"] = job_parts.OptimizerPart(model, optimizer) if self.distributed else optimizer
        if self.loader is not None and "data" not in states and hasattr(self.loader, "state_dict"):
            parts[per_rank_part(self.rank) if self.per_rank_data else "data"] = self.loader
        return {**parts, **states}

    # -- entering and leaving ----------------------------------------------------------

    def __enter__(self) -> TrainingSession:
        try:
            return self._enter()
        except BaseException as exc:  # Python calls no __exit__ when __enter__ raises: let go of the run here
            self._abandon(exc)
            raise

    def _abandon(self, exc: BaseException) -> None:
        """A start that failed lets go of what it took: the checkpointer (the run's one-writer lease, held for
        as long as this process lives otherwise: another job of the run refused) and the progress writer."""
        try:
            self.__exit__(type(exc), exc, exc.__traceback__)
        except Exception as err:  # the start's own error is the one raised
            log.warning("after a failed start: %s", err)

    def _enter(self) -> TrainingSession:
        self.handoff = Handoff.load(self.catalog)
        self.watch = LossWatch(spike_factor=self.spike_factor or self.handoff.spike_factor or float("inf"))
        if self.handoff.launch_id is not None and self.catalog is not None:
            self._writer = ProgressWriter(
                self.catalog, self.handoff.launch_id, self.rank, interval_s=self.heartbeat_s,
                keep_losses=self.rank == 0,
            )  # fmt: skip
            self._writer.start("restoring")
        if self.distributed:
            self._smoke_test()
        with progress.tallied() as read:  # every byte of the restore point, hashed once as it is read
            self.start_step = self._restore_or_say_why()
        self._after_restore()
        if self._writer is not None:
            self._writer.report(self.start_step, None, position_of(self.loader))
            restored = {
                "checkpoint_id": self.restored_checkpoint_id,
                "step": self.start_step,
                "bytes_read": read.bytes,
                "read_from": self.read_from or None,  # bytes by tier (and by host, spread over hosts' disks)
            }
            layout = self._ckpt.layout if isinstance(self._ckpt, ShardedCheckpointer) else None
            self._writer.note(
                start_step=self.start_step, received=self._received(), restored=restored, layout=layout
            )
            self._writer.busy("starting")  # until the first step: compiling, warming up
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        closed: BaseException | None = None
        try:
            if self._ckpt is not None:
                self._ckpt.close()  # an in-flight async save is committed (or its error raised) first
        except BaseException as err:  # the supervisor still hears how this rank ended
            closed = err
            raise
        finally:
            if self._writer is not None:
                comeback.tell_unfinished(self.handoff.comeback if self.rank == 0 else None, self._writer)
                ok = exc is None and closed is None
                self._writer.finish(models.RankState.FINISHED if ok else models.RankState.FAILED)

    def _after_restore(self) -> None:
        """The loss watch seeded with the run's losses up to the restore point; a bad data window the
        supervisor handed over stepped over (``after_restore``)."""
        if self.catalog is not None:
            after_restore.seed_watch(self.watch, self.catalog, self.run, self.start_step)
        after_restore.skip_window(self.loader, self.handoff.skip)

    def _received(self) -> dict[str, Any]:
        h = self.handoff
        world = dist.get_world_size() if self.distributed else 1
        got = {"world_size": world, "lr_scale": h.lr_scale, "global_batch": h.global_batch, "skip": h.skip}
        return {**got, **({"layout": h.layout.as_dict()} if h.layout else {})}

    # -- restore --------------------------------------------------------------------------

    def _smoke_test(self) -> None:
        """The new group carries a collective before anything else runs on it; a failure is told to the
        supervisor (the rebuild failed, not the job) before it ends the job."""
        try:
            group.smoke_test()
        except group.GroupBroken as exc:
            if self._writer is not None:
                self._writer.note(group_failed={"reason": str(exc)[:1000]})
                self._writer.finish(models.RankState.FAILED)
            raise
        if self._writer is not None:
            self._writer.note(group_ready_at=time.time())

    def _restore_or_say_why(self) -> int:
        """Restore; a restore that fails is told to the supervisor (what failed, and whether retrying
        may help) before it ends the job, so that it reads as a failed restore, not a job that cannot start."""
        try:
            return self._restore()
        except Exception as exc:
            if self._writer is not None:
                why = {"reason": f"{type(exc).__name__}: {exc}"[:1000], "transient": is_transient(exc)}
                self._writer.note(restore_failed=why)
                self._writer.finish(models.RankState.FAILED)
            raise

    def _restore(self) -> int:
        if not self.distributed:
            ck = Checkpointer(
                self.run,
                states={**self.parts, "rng": RNGState()},
                root=self.root,
                catalog=self.catalog,
                mode=self.mode,
                format=self.format,
            )
            self._ckpt = ck
            got = ck.restore_latest(target=self.handoff.restore)
            self.skipped = ck.skipped
            self.restored_from = got.path if got is not None else None
            self.restored_checkpoint_id = got.checkpoint_id if got is not None else None
            if got is not None:
                self.read_from = assemble.read_from([], got.bytes_read, got.source, got.fetched)
            return got.step if got is not None else 0
        sck = ShardedCheckpointer(
            self.run, root=self.root, catalog=self.catalog, mode=self.mode, layout=job_parts.job_layout(
                self.layout, self.handoff.layout, self.parts.get("model"), dist.get_world_size()
            ),
            model_shape=self.model_shape, per_rank_data=self.per_rank_data, format=self.format,
        )  # fmt: skip
        self._ckpt = sck
        restored = sck.restore_latest(self._tree, target=self.handoff.restore)
        self.skipped = sck.skipped
        self.restored_checkpoint_id = sck.restored_checkpoint_id
        self.read_from = sck.read_from
        if restored is None:
            return 0
        step, tree, mine = restored
        for name, part in self.parts.items():
            part.load_state_dict(tree[name])
        job_parts.load_rank_state(self.parts, mine)
        return step

    # -- the loop -----------------------------------------------------------------------

    def train(self, step: Callable[[int, Any], float | None], total: int, *, restarts: int = 0) -> int:
        """Run ``step(i, batch)`` for every step left, the batches drawn from the session's loader, each
        returned loss reported (saves when due); the last step run. ``restarts``: an exception a step raises
        restores the newest checkpoint in this process and the loop goes on from it, at most this many
        times (one process only; :mod:`rewind.infra.training.restart` says what it does and does not)."""
        return restart.run(self, step, total, restarts)

    def restart_from_newest(self) -> int | None:
        """In-process restart: the newest checkpoint that proves itself loaded into the live state (model,
        optimizer, loader position, random generators); its step, or None when there is none."""
        if not isinstance(self._ckpt, Checkpointer):
            raise ConfigError("in-process restart takes one process, inside the session's `with` block")
        got = self._ckpt.restore_latest()
        if got is None:
            return None
        self.start_step, self.restored_checkpoint_id = got.step, got.checkpoint_id
        for part in self.parts.values():
            restart.undo_step(part)
        self.watch = LossWatch(spike_factor=self.watch.spike_factor)
        self._after_restore()  # the losses before the restore point (not the undone steps'); the bad window
        return got.step

    def note_restart(self, **facts: Any) -> None:
        """Tell the supervisor of an in-process restart (kept with the rank's progress, newest last)."""
        self._restarts.append(facts)
        if self._writer is not None:
            self._writer.note(restarts=list(self._restarts))

    def steps(self, total: int) -> Iterator[int]:
        """The steps left to run: ``start_step + 1`` to ``total`` (the supervisor shows progress out of ``total``)."""
        if self._writer is not None:
            self._writer.note(total_steps=total)
        return iter(range(self.start_step + 1, total + 1))

    def report(self, step: int, loss: float | None = None, *, samples: int | None = None) -> None:
        """Progress for the supervisor; raises ``TrainingAnomaly`` on NaN/Inf or a spike; saves when due."""
        value = None if loss is None else float(loss)
        self.last_step = step
        position = samples if samples is not None else position_of(self.loader)
        if self._writer is not None:
            self._writer.report(step, value, position)
            if step == self.start_step + 1:
                self._writer.busy(None)
        if not self._prepared and self.checkpoint_every and step % self.checkpoint_every:
            self._prepare()  # not at a save's step: that save would only wait for it
        if value is not None:
            self._watch_loss(step, value, position)
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            self.save(step, metrics={} if value is None else {"loss": value})

    def _watch_loss(self, step: int, loss: float, position: int | None) -> None:
        """``TrainingAnomaly`` on NaN/Inf, a spike, or a comeback that diverged, told to the supervisor first
        (a diverging comeback says no position: no data is skipped for it)."""
        found = self.watch.observe(step, loss)
        seen = (found.kind, found.reason) if found is not None else None
        kind, reason = seen or (comeback.KIND, self._compare(step, loss))
        if reason is None:
            return
        if self._writer is not None:
            at = {"kind": kind, "step": step, "reason": reason, "position": position if seen else None}
            self._writer.note(anomaly=at)
        raise TrainingAnomaly(reason)

    def _compare(self, step: int, loss: float) -> str | None:
        """Rank 0 after a restore: why the comeback diverged at this step, if it did (``comeback``)."""
        replays = (
            self.rank == 0 and position_of(self.loader) is not None
        )  # the same samples at the same steps
        return comeback.check(self.handoff.comeback if replays else None, step, loss, self._writer)

    def save(self, step: int, *, metrics: Mapping[str, float] | None = None) -> None:
        """A checkpoint now (the supervisor knows the rank is busy saving, not hung)."""
        if self._writer is not None:
            self._writer.busy("saving")
        try:
            self._save(step, metrics)
        finally:
            if self._writer is not None:
                self._writer.busy(None)

    def _prepare(self) -> None:
        """Async saves: the staging memory made before the first save (``prepare``), once the state has its
        saved shapes; when, in one process and sharded, is docs/design.md's rule (section 2)."""
        if isinstance(self._ckpt, Checkpointer):
            optimizers = [p for p in self.parts.values() if isinstance(p, torch.optim.Optimizer)]
            if all(o.state for o in optimizers):  # each has taken its first step
                self._prepared = True
                self._ckpt.prepare()
            return
        self._prepared = True  # decided once, the same on every rank
        if not isinstance(self._ckpt, ShardedCheckpointer) or self._ckpt.mode is not SaveMode.ASYNC:
            return
        if self.start_step > 0:  # restored (maybe a fresh optimizer: its zero-lr step undone once asked)
            try:
                with job_parts.fresh_kept(self.parts):
                    state = self._tree()
            except Exception as exc:  # the save that needs it says why, on every rank
                log.warning("staging shells not prepared: %s", exc)
                return
            self._ckpt.prepare(state)

    def _tree(self) -> dict[str, Any]:
        """The state of every part, as a sharded save and restore take it."""
        return {k: v.state_dict() for k, v in self.parts.items()}

    def _save(self, step: int, metrics: Mapping[str, float] | None) -> None:
        if isinstance(self._ckpt, Checkpointer):
            self._ckpt.save(step, metrics=metrics)
        elif isinstance(self._ckpt, ShardedCheckpointer):
            with job_parts.fresh_kept(
                self.parts
            ) as fresh:  # a fresh optimizer's zero-lr step undone once saved
                self._ckpt.save(step, self._tree(), job_parts.rank_state(fresh), metrics=dict(metrics or {}))
        else:
            raise ConfigError("save() outside the session's `with` block")

    def note(self, **facts: Any) -> None:
        """Tell the supervisor what the job applied (e.g. ``lr=...``, ``global_batch=...``)."""
        if self._writer is not None:
            self._writer.note(applied=facts)
