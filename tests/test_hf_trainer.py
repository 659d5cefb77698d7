"""A ``transformers.Trainer`` job with ``RewindCallback`` (examples/hf_trainer.py), protected by the flows:
SIGKILLed right after its step-20 checkpoint is committed, recovered by ``recover-training``, and finished
with the weights of an uninterrupted run, bit for bit; its progress reached the supervisor; Trainer's
checkpoints are Rewind's (verified, with lineage, not pinned, none left under ``output_dir``)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rewind.infra.catalog import incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.states import CheckpointStatus
from tests.integrity_support import flip
from tests.trainproc import REPO, assert_same_weights, uninterrupted

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, SAVE = 40, 10


def command(run: str, out: Path) -> list[str]:
    return ["python", "-m", "rewind.examples.hf_trainer", "--run", run, "--steps", str(STEPS),
            "--save-steps", str(SAVE), "--out", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same Trainer job, uninterrupted and unsupervised (its own SQLite catalog)."""
    home = tmp_path_factory.mktemp("hf-ref")
    return uninterrupted(command("ref", home / "out"), home)


@pytest.mark.timeout(600)
def test_a_trainer_job_killed_after_a_checkpoint_is_recovered_bit_exact(
    prefect_api, rewind_env, reference, run_name, tmp_path
):
    from rewind.flows.training import protect_training, recover_training, summary

    out = tmp_path / "out"
    fault = {"REWIND_FAULT": "kill:hf.committed@20", "REWIND_FAULT_ONCE": str(tmp_path / "fired"),
             "OMP_NUM_THREADS": "1"}  # fmt: skip
    protected = summary(
        protect_training(run_name, command(run_name, out), str(REPO), env=fault, return_state=True)
    )
    assert protected["status"] == "crash", protected
    cat = Catalog()
    first = jobs.launches(cat, run_name)[0]
    assert max(r.step or 0 for r in jobs.progress(cat, first.id)) >= 20  # the callback's progress rows

    # The newest checkpoint is damaged before the recovery: the flow proves its manifest and chooses it;
    # the job, checking every byte before Trainer reads one, refuses it and resumes from step 10.
    (step20,) = [c for c in lineage.checkpoints(cat, run_name, 20)]
    flip(Path(step20.path) / "model.safetensors")
    recovered = summary(recover_training(protected["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered
    inc = incidents.get_incident(cat, protected["incident_id"])
    assert inc.details["restore_point_refused"] == step20.id, inc.details
    assert lineage.get_checkpoint(cat, inc.restored_checkpoint_id).step == 10
    assert_same_weights(out / "final.safetensors", reference)

    kept = [c for c in lineage.checkpoints(cat, run_name) if c.status == CheckpointStatus.VERIFIED]
    assert sorted(c.step for c in kept) == [10, 20, 30, 40] and not any(c.pinned for c in kept)
    assert not list((out / "trainer").glob("checkpoint-*"))  # taken over, nothing left behind
    # Rewind's to keep or delete: retention frees the disk, as for its own checkpoints.
    gc = subprocess.run([sys.executable, "-m", "rewind.flows.cli", "gc", run_name, "--keep-last", "1"],
                        env=os.environ, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert gc.returncode == 0, gc.stderr
    left = sorted(p.name for p in (Path(rewind_env["REWIND_CHECKPOINT_ROOT"]) / run_name).glob("step-*"))
    assert left == ["step-40"], left


def test_a_nan_loss_from_trainer_is_an_anomaly(rewind_env, run_name):
    from transformers import TrainerControl, TrainerState

    from rewind.infra.training.session import TrainingAnomaly
    from rewind.integrations.transformers import RewindCallback

    cb = RewindCallback(run_name)
    state = TrainerState()
    state.global_step = 7
    cb.on_log(None, state, TrainerControl(), logs={"loss": 2.5})
    with pytest.raises(TrainingAnomaly, match="step 7"):
        cb.on_log(None, state, TrainerControl(), logs={"loss": math.nan})
    assert cb.resume_point() is None  # a run with no checkpoint: a fresh start


def test_a_take_over_killed_half_way_leaves_nothing_that_stays(tmp_path):
    """Killed before its adoption, a take-over leaves a temporary directory (swept like a killed save's) or a
    step directory with no manifest (replaced by the next take-over of that step, not kept beside it)."""
    from rewind.infra.format import local_tier, store
    from rewind.infra.inventory.takeover import take_over

    run_dir = tmp_path / "tier" / "run"
    (run_dir / "step-20").mkdir(parents=True)
    (run_dir / "step-20" / "optimizer.pt").write_bytes(b"half")  # renamed in, never adopted
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / f"step-20.tmp-{dead.pid}-0123456789ab").mkdir()  # moved in by a process now gone
    trainer = tmp_path / "out" / "checkpoint-20"
    trainer.mkdir(parents=True)
    (trainer / "model.safetensors").write_bytes(b"weights")

    kept = take_over(trainer, run_dir, 20)
    assert kept == run_dir / "step-20" and sorted(p.name for p in kept.iterdir()) == ["model.safetensors"]
    assert not trainer.exists()
    assert [p.name for p in store.sweep_temp(run_dir)] == [f"step-20.tmp-{dead.pid}-0123456789ab"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-20"]
    assert local_tier.read(run_dir.parent) is not None  # the tier's disk is marked, as a save marks it


def test_a_second_trainer_job_of_the_same_run_is_refused_while_the_first_lives(rewind_env, run_name):
    """A sweep with one hard-coded run name, or a relaunch while the old job lives: the second job is refused
    as it begins training, naming the live writer, instead of both interleaving checkpoints in one lineage
    (and a resume handing one job the other's weights). An evaluator's resume_point() is not refused; the
    run is free again once the first job ends."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from rewind.integrations.transformers import RewindCallback

    args = TrainingArguments(output_dir=os.devnull, report_to=[])
    first = RewindCallback(run_name)
    first.on_train_begin(args, TrainerState(), TrainerControl())  # this process now writes the run
    begin = (
        "from transformers import TrainerControl as C, TrainerState as S, TrainingArguments as A; "
        "from rewind.integrations.transformers import RewindCallback as R; "
        f"r = R({run_name!r}); r.resume_point(); print('resumed', flush=True); "
        f"r.on_train_begin(A(output_dir={os.devnull!r}, report_to=[]), S(), C())"
    )
    second = [sys.executable, "-c", begin]
    done = subprocess.run(second, env=os.environ, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0 and "RunBusy" in done.stderr, done.stderr[-2000:]
    assert "resumed" in done.stdout  # reading the run is not writing it
    first.on_train_end(args, TrainerState(), TrainerControl())
    done = subprocess.run(second, env=os.environ, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
