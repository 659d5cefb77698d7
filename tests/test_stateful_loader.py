"""torchdata's StatefulDataLoader as the session's loader: its own state (sampler position, shuffling
generator) is checkpointed and restored exactly, so a job SIGKILLed after a checkpoint, mid-epoch, ends
bit-identical to one never interrupted. Under torchrun such a per-rank loader is refused in one line (it
cannot be resharded: ResumableLoader can)."""

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


REFUSED_UNDER_TORCHRUN = """
import torch, torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from rewind.infra.errors import ConfigError
from rewind.infra.training.session import TrainingSession
dist.init_process_group("gloo")
data = torch.utils.data.TensorDataset(torch.randn(64, 2))
try:
    TrainingSession("r", model=torch.nn.Linear(2, 1), loader=StatefulDataLoader(data, batch_size=4))
    print("accepted", flush=True)
except ConfigError as exc:
    print("refused:", exc, flush=True)
dist.destroy_process_group()
"""


def test_a_per_rank_loader_is_refused_under_torchrun_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    from tests.torchrun_support import torchrun

    script = tmp_path / "job.py"
    script.write_text(REFUSED_UNDER_TORCHRUN)
    env = {**os.environ, "REWIND_HOME": str(tmp_path), "REWIND_CATALOG_URL": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*torchrun(2), str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stdout.splitlines() if line.startswith(("refused", "accepted"))]
    assert len(said) == 2 and all("cannot be resharded" in line for line in said), done.stdout
