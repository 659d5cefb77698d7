"""A PyTorch Lightning job with ``RewindCallback`` (examples/lightning_job.py: a torchdata
``StatefulDataLoader``, AdamW and a step-wise scheduler), protected by the flows: SIGKILLed right after its
step-20 checkpoint is committed, recovered by ``recover-training``, and finished, two epochs later, with
the weights of an uninterrupted run, bit for bit; Lightning's checkpoints are Rewind's (verified, with
lineage), and its CheckpointIO never opens a file it was not handed by a proven restore."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewind.infra.catalog import incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.states import CheckpointStatus
from rewind.infra.errors import ConfigError
from tests.trainproc import REPO, assert_same_weights, uninterrupted

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

STEPS, EVERY = 70, 10  # 32 batches an epoch: the resume crosses two epoch boundaries


def command(run: str, out: Path) -> list[str]:
    return ["python", "-m", "rewind.examples.lightning_job", "--run", run, "--steps", str(STEPS),
            "--every", str(EVERY), "--out", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same Lightning job, uninterrupted and unsupervised (its own SQLite catalog)."""
    home = tmp_path_factory.mktemp("lightning-ref")
    return uninterrupted(command("ref", home / "out"), home)


@pytest.mark.timeout(600)
def test_a_lightning_job_killed_after_a_checkpoint_is_recovered_bit_exact(
    prefect_api, rewind_env, reference, run_name, tmp_path
):
    from rewind.flows.training import protect_training, recover_training, summary

    out = tmp_path / "out"
    fault = {"REWIND_FAULT": "kill:lightning.committed@20", "REWIND_FAULT_ONCE": str(tmp_path / "fired"),
             "OMP_NUM_THREADS": "1"}  # fmt: skip
    protected = summary(
        protect_training(run_name, command(run_name, out), str(REPO), env=fault, return_state=True)
    )
    assert protected["status"] == "crash", protected
    cat = Catalog()
    first = jobs.launches(cat, run_name)[0]
    assert max(r.step or 0 for r in jobs.progress(cat, first.id)) >= 20  # the callback's progress rows

    recovered = summary(recover_training(protected["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered
    inc = incidents.get_incident(cat, protected["incident_id"])
    assert lineage.get_checkpoint(cat, inc.restored_checkpoint_id).step == 20
    assert_same_weights(out / "final.safetensors", reference)
    kept = [c for c in lineage.checkpoints(cat, run_name) if c.status == CheckpointStatus.VERIFIED]
    assert sorted(c.step for c in kept) == list(range(EVERY, STEPS + 1, EVERY))
    assert kept[-1].metrics.get("loss") is not None


def test_the_checkpoint_io_refuses_a_path_it_did_not_restore(rewind_env, run_name, tmp_path):
    from rewind.integrations.lightning import RewindCallback

    rewind = RewindCallback(run_name, every_n_steps=5)
    assert rewind.resume_point() is None  # a fresh run
    planted = tmp_path / "last.ckpt"
    planted.write_bytes(b"not a checkpoint Rewind proved")
    with pytest.raises(ConfigError, match="loads only the checkpoint resume_point"):
        rewind.checkpoint_io.load_checkpoint(str(planted))
    with pytest.raises(ConfigError, match="every_n_steps"):
        RewindCallback(run_name, every_n_steps=0)


def _fit(run: str, *, accumulate: int, strategy: object = "auto") -> None:
    """A tiny LightningModule fitted for 3 optimizer steps in this process, a checkpoint asked for at each."""
    import lightning.pytorch as pl
    import torch

    from rewind.integrations.lightning import RewindCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    rewind = RewindCallback(run, every_n_steps=1)
    trainer = pl.Trainer(
        max_steps=3, accumulate_grad_batches=accumulate, callbacks=[rewind], plugins=[rewind.checkpoint_io],
        strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(
        Tiny(), torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4), ckpt_path=rewind.resume_point()
    )


def test_with_gradient_accumulation_no_checkpoint_is_taken_mid_accumulation(rewind_env, run_name):
    """Step 0 at a batch's end is before the first optimizer step (its gradients are in no checkpoint)."""
    _fit(run_name, accumulate=4)
    assert [c.step for c in lineage.checkpoints(Catalog(), run_name)] == [1, 2, 3]


def test_a_strategy_that_saves_without_its_checkpoint_io_is_refused_not_left_unprotected(
    rewind_env, run_name
):
    """DeepSpeed's engine writes its own files, ignoring CheckpointIO: the job stops at its first save,
    saying so, rather than train for days with nothing kept."""
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class SavesItsOwnWay(SingleDeviceStrategy):
        def save_checkpoint(self, checkpoint: dict, filepath: object, storage_options: object = None) -> None:
            """As DeepSpeedStrategy does: its engine's files, not the CheckpointIO's."""

    with pytest.raises(ConfigError, match="SavesItsOwnWay saved step 1 without its CheckpointIO"):
        _fit(run_name, accumulate=1, strategy=SavesItsOwnWay(device=torch.device("cpu")))
    assert lineage.checkpoints(Catalog(), run_name) == []
