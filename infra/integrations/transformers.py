"""A Hugging Face ``transformers.Trainer`` job as a protected Rewind run: ``RewindCallback``.

    from rewind.integrations.transformers import RewindCallback

    rewind = RewindCallback("my-run")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[rewind])
    trainer.train(resume_from_checkpoint=rewind.resume_point())

On each of Trainer's saves, the ``checkpoint-N`` directory Trainer has just written (weights, optimizer,
scheduler, RNG, ``trainer_state.json``: everything its own resume reads) is taken over into Rewind's local
tier, hashed and registered in the catalog with its lineage, like any checkpoint Rewind wrote: replicated,
scrubbed, kept by retention (not pinned). Nothing stays under ``output_dir``. ``resume_point()`` is the
newest checkpoint that proves itself byte for byte (fetched from the nearest tier that has one), or the
one the recovery chose, so Trainer unpickles only bytes the catalog recorded; ``None`` on a fresh run.
Under a supervisor (``protect-training``), each step is reported as progress and a NaN/Inf or spiking
logged loss is an anomaly, as for ``TrainingSession``.

Put it first in ``callbacks``: a callback after it finds no ``checkpoint-N`` in ``on_save``.

Limits: single-process jobs (``args.world_size == 1``; under torchrun each rank's take-over would need a
barrier Trainer does not expose); not with ``load_best_model_at_end`` (Trainer would look for the best
checkpoint under ``output_dir``) or ``save_only_model`` (the optimizer would not be saved, so a resume could
not be exact) or ``push_to_hub`` of each checkpoint (the upload would read a folder that moved); not
under hyperparameter search (its trials save elsewhere); a data window the supervisor asks to skip is not skipped (Trainer has no global position).
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "rewind.integrations.transformers needs transformers: pip install 'rewind[hf]'"
    ) from exc

from rewind.infra import config
from rewind.infra.catalog import lineage, models
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.writer_lease import WriterLease
from rewind.infra.errors import ConfigError, NoRestorableCheckpoint, NotFoundError
from rewind.infra.faults import fault_point
from rewind.infra.format import store
from rewind.infra.format.verify import verify_files
from rewind.infra.health.signals import LossWatch
from rewind.infra.integrations import supervised
from rewind.infra.inventory.adopt import adopt
from rewind.infra.inventory.takeover import take_over
from rewind.infra.restore import execute, plan
from rewind.infra.restore.execute import Restored
from rewind.infra.training.progress import ProgressWriter
from rewind.infra.training.session import Handoff

log = logging.getLogger("rewind.transformers")
FORMAT = "hf-trainer"


class RewindCallback(TrainerCallback):
    """Trainer's checkpoints kept, proven and resumed by Rewind; progress and anomalies for the supervisor."""

    def __init__(
        self,
        run: str,
        *,
        spike_factor: float | None = None,
        heartbeat_s: float = 1.0,
        root: Path | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        self.run = run
        self.root = Path(root or config.checkpoint_root())
        self.catalog = catalog or Catalog()
        self.handoff = Handoff.load(self.catalog)
        factor = spike_factor or self.handoff.spike_factor or math.inf
        self.watch = LossWatch(spike_factor=factor)
        self.heartbeat_s = heartbeat_s
        self.start_step = 0
        self._writer: ProgressWriter | None = None
        self._held = contextlib.ExitStack()  # the restore point's lease, until Trainer has read it
        self._stepped = False
        self._lease: WriterLease | None = None  # the run's writer lease, once this callback holds it

    def _write_lease(self) -> WriterLease:
        """Become the run's one writer (``RunBusy`` naming the live one): two jobs of one run name (a sweep,
        a relaunch while the old job lives) must never interleave their checkpoints in one lineage."""
        if self._lease is None:
            lease = WriterLease(self.catalog, lineage.ensure_run(self.catalog, self.run))
            lease.take()
            self._lease = lease
        return self._lease

    # -- before train() ----------------------------------------------------------------------------

    def resume_point(self) -> str | None:
        """The directory to give ``Trainer.train(resume_from_checkpoint=...)``: every byte checked.

        The recovery's chosen restore point first (an older one when its every copy fails), else the
        newest that proves itself; ``None`` on a run with no checkpoint. A failure is told to the supervisor
        (a failed restore, not a job that cannot start) before it is raised."""
        writer = self._start_writer("restoring")
        store.sweep_temp(self.root / self.run)  # what a take-over killed half-way left
        try:
            done = self._restore()
        except Exception as exc:
            supervised.restore_failed(writer, exc)
            self._held.close()
            raise
        if done is None:
            return None
        self.start_step = done.step
        supervised.restored(
            writer, checkpoint_id=done.checkpoint_id, step=done.step, bytes_read=done.manifest.total_bytes
        )
        log.info("resuming %s from step %d (%s)", self.run, done.step, done.directory)
        return str(done.directory)

    def _restore(self) -> Restored[None] | None:
        target = self.handoff.restore
        try:
            run = lineage.get_run(self.catalog, self.run)
        except NotFoundError:
            if target is not None:
                raise
            return None  # a fresh run
        if not lineage.restorable(self.catalog, run.id):
            if target is not None:  # the recovery chose a restore point: starting over would lose the run
                raise NoRestorableCheckpoint(f"run {self.run!r} has no checkpoint left to restore", ())
            log.warning("%s has no checkpoint left to restore: training starts from the beginning", self.run)
            return None
        p = plan.plan(self.catalog, self.run, root=self.root, target=target)
        # held until Trainer has read it (its first step): retention must not delete it under the read
        return self._held.enter_context(execute.restoring(self.catalog, p, verify_files))

    def _start_writer(self, busy: str) -> ProgressWriter | None:
        self._writer = supervised.start_writer(
            self._writer, self.catalog, self.handoff, self.heartbeat_s, busy
        )
        return self._writer

    # -- Trainer's events --------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        _check(args)
        self._write_lease()
        if self.handoff.skip is not None:
            log.warning(
                "the supervisor asked to skip samples %d..%d: Trainer cannot, not skipped", *self.handoff.skip
            )
        writer = self._start_writer("starting")
        if writer is not None:
            writer.busy("starting")
            writer.note(start_step=state.global_step, total_steps=state.max_steps)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if not self._stepped:
            self._stepped = True
            self._held.close()  # Trainer has read the restore point by now
        if self._writer is None:
            return
        self._writer.report(state.global_step, _last_loss(state), None)
        # Trainer saves and evaluates after this event: busy, so a long save is not taken for a hang
        if control.should_save:
            self._writer.busy("saving")
        elif control.should_evaluate:
            self._writer.busy("evaluating")
        elif state.global_step == self.start_step + 1:
            self._writer.busy(None)  # the first step is done: no longer starting

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._writer is not None and not control.should_save:
            self._writer.busy(None)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        loss = (logs or {}).get("loss")
        if not isinstance(loss, int | float):
            return
        supervised.check_loss(self._writer, self.watch, state.global_step, float(loss))

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        written = Path(args.output_dir or "trainer_output") / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        try:
            fault_point("hf.taken_over", state.global_step)
            kept = take_over(written, self.root / self.run, state.global_step)
            got = adopt(self.catalog, kept, run=self.run, step=state.global_step, fmt=FORMAT, owned=True)
            self._write_lease().touch()
            fault_point("hf.committed", state.global_step)
            log.info("%s step %d: checkpoint %d committed (%s)", self.run, got.step, got.checkpoint_id, kept)
        finally:
            if self._writer is not None:
                self._writer.busy(None)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._held.close()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._writer is not None:
            self._writer.finish(models.RankState.FINISHED)
            self._writer = None


def _check(args: TrainingArguments) -> None:
    """The Trainer settings under which Rewind's checkpoints cannot be what a resume needs: refused."""
    if args.world_size > 1:
        raise ConfigError("RewindCallback protects single-process Trainer jobs (world_size 1) for now")
    if args.load_best_model_at_end:
        raise ConfigError("RewindCallback takes each checkpoint out of output_dir: load_best_model_at_end "
                          "would not find the best one there; leave it off")  # fmt: skip
    if args.save_only_model:
        raise ConfigError("save_only_model=True leaves the optimizer and scheduler out: a resume from such a "
                          "checkpoint is not exact; leave it off")  # fmt: skip
    if args.push_to_hub and getattr(args.hub_strategy, "value", args.hub_strategy) in (
        "checkpoint",
        "all_checkpoints",
    ):
        raise ConfigError("push_to_hub with hub_strategy checkpoint/all_checkpoints uploads the checkpoint "
                          "folder that RewindCallback moves into Rewind's tier; use hub_strategy 'end'")  # fmt: skip
    if str(args.save_strategy) in ("no", "SaveStrategy.NO"):
        log.warning("save_strategy is 'no': Trainer never saves, so Rewind has nothing to protect")


def _last_loss(state: TrainerState) -> float | None:
    for entry in reversed(state.log_history[-3:]):
        if isinstance(entry.get("loss"), int | float):
            return float(entry["loss"])
    return None
