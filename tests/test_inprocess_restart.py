"""In-process restart: a step that raises is undone by restoring the newest checkpoint in the same process
(model, optimizer, loader position, random generators, every byte hashed), and the job ends bit-exact
with an uninterrupted run; without restarts left, or before any checkpoint, the error ends the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainproc import REPO, assert_same_weights


def _job(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": ""}
    env.pop("REWIND_LAUNCH_ID", None)
    return subprocess.run([sys.executable, "-m", "tests.restart_job", "run", str(home / "out"), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)  # fmt: skip


def test_a_step_that_raises_is_undone_in_process_and_the_run_ends_bit_exact(tmp_path: Path) -> None:
    plain = _job(tmp_path / "plain", "60", "0")
    assert plain.returncode == 0, plain.stderr[-2000:]
    hurt = _job(tmp_path / "hurt", "60", "1", "25")
    assert hurt.returncode == 0, hurt.stderr[-2000:]
    told = json.loads(hurt.stdout.strip().splitlines()[-1])
    assert told["last"] == 60, told
    (restart,) = told["restarts"]  # one restart, from the newest checkpoint before the failing step
    assert restart["after_step"] == 24 and restart["restored_step"] == 20, restart  # step 25 never reported
    assert "a transient device error at step 25" in restart["error"], restart
    assert_same_weights(
        tmp_path / "hurt" / "out" / "final.safetensors", tmp_path / "plain" / "out" / "final.safetensors"
    )


def test_without_restarts_left_or_a_checkpoint_to_go_back_to_the_error_ends_the_job(tmp_path: Path) -> None:
    none_left = _job(tmp_path / "a", "60", "0", "25")
    assert none_left.returncode != 0 and "a transient device error at step 25" in none_left.stderr
    too_early = _job(tmp_path / "b", "60", "3", "5")  # before the first checkpoint (step 10)
    assert too_early.returncode != 0 and "a transient device error at step 5" in too_early.stderr


@pytest.mark.parametrize("scaler", ["scaler", "scaler-off"])
def test_a_step_that_fails_after_its_grad_scaler_unscaled_is_undone_and_retried(
    tmp_path: Path, scaler: str
) -> None:
    """A step that raised after ``GradScaler.unscale_`` (a gradient-norm check) is retried from the restored
    checkpoint: the scaler's record of that unscale is undone with the step (torch would refuse the retried
    step's ``unscale_`` for ever), and the run ends bit-exact with one that never failed. A disabled scaler
    (no mixed precision) keeps no record: the restart is the same."""
    plain = _job(tmp_path / "plain", "40", "0", "-1", scaler)
    assert plain.returncode == 0, plain.stderr[-2000:]
    hurt = _job(tmp_path / "hurt", "40", "1", "25", scaler)
    assert hurt.returncode == 0, hurt.stderr[-2000:]
    (restart,) = json.loads(hurt.stdout.strip().splitlines()[-1])["restarts"]
    assert restart["restored_step"] == 20, restart
    assert_same_weights(
        tmp_path / "hurt" / "out" / "final.safetensors", tmp_path / "plain" / "out" / "final.safetensors"
    )
