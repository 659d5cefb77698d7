"""A sharded save before the optimizer's first step (``session.save(0)`` under torchrun) leaves the run as it
would have been without it, and a restore of that checkpoint starts the optimizer as fresh as it was.

DCP's optimizer state dict gives an optimizer without state its state by a zero-learning-rate step: Adam's
step count then starts at 1, so every later update differed (its bias correction) from the run's own, in
the job that saved and in every job that resumed from that checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
STEPS = 6


def _ranks(home: Path, out: str, save_first: str) -> dict[str, object]:
    from tests.torchrun_support import torchrun

    env = {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": "",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [
        *torchrun(2),
        "-m",
        "tests.fresh_optimizer_job",
        "job",
        str(home / out),
        str(STEPS),
        save_first,
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((home / out / "start.json").read_text())


def _same(home: Path, out: str) -> bool:
    a, b = (
        load_file(str(home / out / "plain.safetensors")),
        load_file(str(home / out / "session.safetensors")),
    )
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_save_before_the_first_step_perturbs_neither_the_run_nor_its_resume(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert _ranks(home, "saved", save_first="1") == {"start": 0, "restored": False}
    assert _same(home, "saved"), "the save before the first step changed the run's training"
    assert _ranks(home, "resumed", save_first="0") == {"start": 0, "restored": True}
    assert _same(home, "resumed"), "the run resumed from the step-0 checkpoint trained differently"


def test_a_save_before_the_first_step_with_gradients_computed_resumes(tmp_path: Path) -> None:
    """Gradients already computed (a job accumulating them over micro-batches) keep DCP from giving the
    optimizer its state at the save: the checkpoint then lacked the optimizer's state that a fresh job's
    restore asks for, and the resume refused its only checkpoint."""
    home = tmp_path / "home"
    assert _ranks(home, "saved", save_first="grads") == {"start": 0, "restored": False}
    assert _same(home, "saved"), "the save with gradients computed changed the run's training"
    assert _ranks(home, "resumed", save_first="0") == {"start": 0, "restored": True}
    assert _same(home, "resumed"), "the run resumed from the step-0 checkpoint trained differently"
