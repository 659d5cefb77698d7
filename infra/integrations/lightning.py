"""A PyTorch Lightning job as a protected Rewind run: ``RewindCallback`` and its ``CheckpointIO``.

    from rewind.integrations.lightning import RewindCallback

    rewind = RewindCallback("my-run", every_n_steps=100)
    trainer = L.Trainer(..., callbacks=[rewind], plugins=[rewind.checkpoint_io], enable_checkpointing=False)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=rewind.resume_point())

Every ``every_n_steps`` optimizer steps the callback asks Lightning for its full checkpoint (model,
optimizers, schedulers, precision, the loops' progress, a stateful loader's position such as torchdata's
``StatefulDataLoader``, every callback's state) and its ``CheckpointIO`` hands it to Rewind's
``Checkpointer``: tensors to safetensors, everything else to JSON (nothing pickled), hashed, committed
with its lineage, replicated, scrubbed and kept like any checkpoint Rewind wrote. The callback's own state
is every random generator (Python, NumPy, torch). ``resume_point()`` restores the newest checkpoint that
proves itself byte for byte (or the one the recovery chose) and gives Lightning a name for it; the
``CheckpointIO`` hands that state back, and loads nothing else (a path of Lightning's own format would be
unpickled). Under a supervisor (``protect-training``) each step is reported as progress and a NaN/Inf or
spiking loss is an anomaly, as with ``TrainingSession``.

Limits: single-process jobs (one device; under a multi-process strategy each rank's save would need
Rewind's sharded checkpointer); a strategy that saves without its ``CheckpointIO`` (DeepSpeed's engine,
FSDP's sharded state) stops the job at its first save, since Rewind would keep nothing; a value Lightning keeps in its checkpoint that is not a tensor, number,
string, list, tuple, dict, bytes or NumPy array (say, an object in ``save_hyperparameters``) is refused
with its path; a data window the supervisor asks to skip is not skipped (a loader has no global position).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "rewind.integrations.lightning needs lightning: pip install 'rewind[lightning]'"
    ) from exc

from rewind.infra import config
from rewind.infra.catalog import models
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.checkpoint.state import RNGState
from rewind.infra.errors import ConfigError
from rewind.infra.faults import fault_point
from rewind.infra.health.signals import LossWatch
from rewind.infra.integrations import supervised
from rewind.infra.training.progress import ProgressWriter
from rewind.infra.training.session import Handoff

log = logging.getLogger("rewind.lightning")
SCHEME = "rewind://"  # the names Lightning is given for Rewind's checkpoints: never a file to open


class _Held:
    """Lightning's checkpoint dict as one state of the checkpointer: set before a save, filled by a restore."""

    def __init__(self) -> None:
        self.value: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.value is None:
            raise ConfigError("no Lightning checkpoint to save")
        return self.value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = dict(state)


class RewindCheckpointIO(CheckpointIO):
    """Lightning's checkpoints go through Rewind's checkpointer; loads only what ``resume_point()`` proved."""

    def __init__(self, owner: RewindCallback) -> None:
        self.owner = owner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.owner.save(checkpoint)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return self.owner.loaded(str(path))

    def remove_checkpoint(self, path: Any) -> None:
        """Rewind's retention decides which checkpoints go, not Lightning."""


class RewindCallback(pl.Callback):
    """Lightning's checkpoints kept, proven and resumed by Rewind; progress and anomalies for the supervisor."""

    def __init__(
        self,
        run: str,
        *,
        every_n_steps: int,
        spike_factor: float | None = None,
        heartbeat_s: float = 1.0,
        root: Path | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ConfigError("every_n_steps must be at least 1")
        self.run, self.every = run, every_n_steps
        self.root = Path(root or config.checkpoint_root())
        self.catalog = catalog or Catalog()
        self.handoff = Handoff.load(self.catalog)
        self.watch = LossWatch(spike_factor=spike_factor or self.handoff.spike_factor or math.inf)
        self.heartbeat_s = heartbeat_s
        self.checkpoint_io = RewindCheckpointIO(self)
        self.start_step = 0
        self._held = _Held()
        self._ckpt: Checkpointer | None = None
        self._resumed: str | None = None  # the name resume_point() gave Lightning
        self._writer: ProgressWriter | None = None
        self._last_saved = -1
        self._loss: float | None = None  # the newest step's loss, recorded with a checkpoint

    # -- before fit() ------------------------------------------------------------------------------

    def resume_point(self) -> str | None:
        """What to give ``Trainer.fit(ckpt_path=...)``: the restored checkpoint's name, every byte proven
        against the catalog; ``None`` on a run with no checkpoint. A failure is told to the supervisor (a
        failed restore, not a job that cannot start) before it is raised."""
        writer = self._start_writer("restoring")
        try:
            got = self._checkpointer().restore_latest(target=self.handoff.restore)
        except Exception as exc:
            supervised.restore_failed(writer, exc)
            raise
        if got is None:
            return None
        self.start_step = self._last_saved = got.step
        supervised.restored(writer, checkpoint_id=got.checkpoint_id, step=got.step, bytes_read=got.bytes_read)
        self._resumed = f"{SCHEME}{self.run}/step-{got.step}"
        log.info("resuming %s from step %d (%s)", self.run, got.step, got.path)
        return self._resumed

    def loaded(self, path: str) -> dict[str, Any]:
        """The state ``resume_point()`` restored, for the name it gave; anything else is refused."""
        if path != self._resumed or self._held.value is None:
            raise ConfigError(
                f"RewindCheckpointIO loads only the checkpoint resume_point() restored ({self._resumed}), "
                f"not {path!r}: a file of Lightning's own format would be unpickled unchecked"
            )
        value, self._held.value = self._held.value, None  # Lightning keeps its own reference
        return value

    def save(self, checkpoint: dict[str, Any]) -> None:
        step = int(checkpoint.get("global_step", 0))
        self._held.value = checkpoint
        try:
            self._checkpointer().save(step, metrics=self._metrics())
        finally:
            self._held.value = None
        self._last_saved = step
        fault_point("lightning.committed", step)

    def _checkpointer(self) -> Checkpointer:
        if self._ckpt is None:
            # the generators travel in Lightning's checkpoint, as this callback's state: restored by fit()
            self._ckpt = Checkpointer(
                self.run, states={"lightning": self._held}, root=self.root, catalog=self.catalog
            )
        return self._ckpt

    def _metrics(self) -> dict[str, float]:
        loss = self._loss
        return {"loss": loss} if loss is not None and math.isfinite(loss) else {}

    def _start_writer(self, busy: str) -> ProgressWriter | None:
        self._writer = supervised.start_writer(
            self._writer, self.catalog, self.handoff, self.heartbeat_s, busy
        )
        return self._writer

    # -- Lightning's events ------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            raise ConfigError("RewindCallback protects single-process Lightning jobs (one device) for now")
        if not isinstance(trainer.strategy.checkpoint_io, RewindCheckpointIO):
            raise ConfigError("give the Trainer plugins=[rewind.checkpoint_io]: Rewind keeps the checkpoints")
        if self.handoff.skip is not None:
            log.warning("the supervisor asked to skip samples %s..%d: a Lightning loader cannot, not skipped",
                        *self.handoff.skip)  # fmt: skip

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        writer = self._start_writer("starting")
        if writer is not None:
            writer.busy("starting")
            writer.note(start_step=trainer.global_step, total_steps=trainer.max_steps)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, loss = trainer.global_step, _loss_of(outputs)
        self._loss = loss
        if loss is not None:
            supervised.check_loss(self._writer, self.watch, step, loss)
        if self._writer is not None:
            self._writer.report(step, loss, None)
            self._writer.busy(None)
        # Step 0 at a batch's end is mid-accumulation (no optimizer step yet): gradients no checkpoint holds
        if step > 0 and step % self.every == 0 and step > self._last_saved:
            if self._writer is not None:
                self._writer.busy("saving")
            trainer.save_checkpoint(f"{SCHEME}{self.run}/step-{step}", weights_only=False)  # the full state
            if self._writer is not None:
                self._writer.busy(None)
            if self._last_saved != step:  # DeepSpeed's engine, FSDP's sharded state: their own files
                raise ConfigError(
                    f"{type(trainer.strategy).__name__} saved step {step} without its CheckpointIO: Rewind "
                    "kept nothing; RewindCallback protects strategies that save through plugins=[checkpoint_io]"
                )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()
        if self._writer is not None:
            self._writer.finish(models.RankState.FINISHED)
            self._writer = None

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._ckpt is not None:  # a save in flight is finished; the run is let go for the next job
            ckpt, self._ckpt = self._ckpt, None
            try:
                ckpt.close()
            except Exception as exc:  # the training's own exception is the one raised
                log.warning("checkpointer closed after the training failed: %s", exc)
        if self._writer is not None:
            self._writer.finish(models.RankState.FAILED)
            self._writer = None

    # -- the callback's own state: every random generator -----------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"rng": RNGState().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "rng" in state_dict:
            RNGState().load_state_dict(state_dict["rng"])


def _loss_of(outputs: Any) -> float | None:
    value = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None
    return float(value.detach())
