"""torchdata's StatefulDataLoader as the session's loader: its own state (sampler position, shuffling
generator) is checkpointed and restored exactly, so a job SIGKILLed after a checkpoint, mid-epoch, ends
bit-identical to one never interrupted. Under torchrun each rank's loader state is its own: restored on as
many ranks (bit-identical), refused in one line on another number (ResumableLoader can be resharded)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.states import CheckpointStatus

REPO = Path(__file__).resolve().parents[1]
STEPS = 100  # 32 batches an epoch: three epoch boundaries


def _start(home: Path, fault: str = "") -> subprocess.Popen[str]:
    env = {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": "",
           "OMP_NUM_THREADS": "1", "REWIND_FAULT": fault}  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "tests.stateful_loader_job", "job", str(home / "out"),
                             str(STEPS)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def test_a_stateful_dataloader_resumes_mid_epoch_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    seed = int(os.environ.get("REWIND_TEST_SEED") or random.randrange(1 << 30))
    print(f"seed {seed}")
    kill_after = random.Random(seed).choice([20, 40, 50])  # mid-epoch (32 batches each) and not
    plain, hurt = tmp_path / "plain", tmp_path / "hurt"
    for d in (plain, hurt):
        d.mkdir()
    done = _start(plain)
    assert done.wait(timeout=300) == 0, done.stdout.read() if done.stdout else ""
    # The job SIGKILLs itself in the save after the one at kill_after: that checkpoint is committed, the
    # next one is not, and a job that runs faster than a watcher can never finish before its kill.
    job = _start(hurt, fault=f"kill:save.before_manifest@{kill_after + 10}")
    job.wait(timeout=300)
    assert job.returncode == -signal.SIGKILL, job.stdout.read() if job.stdout else ""
    assert not (hurt / "out").exists(), f"the job finished before it was killed (seed {seed})"
    cat = Catalog(f"sqlite:///{hurt / 'catalog.db'}")
    done_steps = [c.step for c in lineage.checkpoints(cat, "job") if c.status != CheckpointStatus.WRITING]
    assert max(done_steps) == kill_after, f"seed {seed}"
    again = _start(hurt)
    said, _ = again.communicate(timeout=300)
    assert again.returncode == 0, said
    a, b = (
        load_file(str(plain / "out" / "final.safetensors")),
        load_file(str(hurt / "out" / "final.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a), f"seed {seed}"


def _ranks(home: Path, n: int, fault: str = "") -> subprocess.CompletedProcess[str]:
    from tests.torchrun_support import torchrun

    env = {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": "",
           "OMP_NUM_THREADS": "1", "REWIND_FAULT": fault, "REWIND_FAULT_ONCE": str(home / "fired")}  # fmt: skip
    cmd = [*torchrun(n), "-m", "tests.stateful_loader_job", "job", str(home / "out"), str(STEPS)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)


def test_per_rank_loaders_under_torchrun_resume_bit_exact_on_as_many_ranks_only(tmp_path: Path) -> None:
    """Each rank's StatefulDataLoader (a StatefulDistributedSampler) is that rank's own state: killed after
    the step-40 checkpoint, two ranks resume bit-identical to an uninterrupted run; one rank refuses the
    run's checkpoints in one line (their loader state is per rank), and starts nothing over."""
    pytest.importorskip("torchdata.stateful_dataloader")
    plain, hurt = tmp_path / "plain", tmp_path / "hurt"
    for d in (plain, hurt):
        d.mkdir()
    done = _ranks(plain, 2)
    assert done.returncode == 0, done.stderr[-2000:]
    killed = _ranks(hurt, 2, fault="kill:save.before_catalog@50")  # step 40 is the newest committed
    assert killed.returncode != 0 and not (hurt / "out").exists(), killed.stderr[-2000:]
    cat = Catalog(f"sqlite:///{hurt / 'catalog.db'}")
    newest = max(c.step for c in lineage.checkpoints(cat, "job") if c.status != CheckpointStatus.WRITING)
    assert newest == 40 and lineage.checkpoints(cat, "job", 40)[0].layout["data"] == "per-rank"

    one = _ranks(hurt, 1)
    assert one.returncode != 0 and "the loader's state is per rank: saved by 2 ranks, this job has 1" in (
        one.stdout + one.stderr
    ), one.stderr[-3000:]
    again = _ranks(hurt, 2)
    assert again.returncode == 0 and "resumed at step 40" in again.stdout, again.stderr[-2000:]
    a, b = (load_file(str(d / "out" / "final.safetensors")) for d in (plain, hurt))
    assert all(torch.equal(a[k], b[k]) for k in a)
