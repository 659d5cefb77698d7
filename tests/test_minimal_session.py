"""The README's first example, run as a user runs it: SIGKILLed in the middle of a save and
started again, it resumes and ends with the weights of a run never interrupted, bit for bit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.states import CheckpointStatus

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "minimal_session.py")
STEPS = 600


def _start(home: Path, out: Path, fault: str = "") -> subprocess.Popen[str]:
    env = {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": "",
           "OMP_NUM_THREADS": "1", "REWIND_FAULT": fault}  # fmt: skip
    return subprocess.Popen([sys.executable, EXAMPLE, "demo", str(out), str(STEPS)], cwd=home, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_the_minimal_example_resumes_bit_exact_after_sigkill(tmp_path: Path) -> None:
    seed = int(os.environ.get("REWIND_TEST_SEED") or random.randrange(1 << 30))
    print(f"seed {seed}")
    kill_after = random.Random(seed).choice(range(40, STEPS // 2, 20))  # a committed checkpoint's step
    plain, hurt = tmp_path / "plain", tmp_path / "hurt"
    for d in (plain, hurt):
        d.mkdir()
    assert _start(plain, plain / "out").wait(timeout=300) == 0

    # SIGKILLed inside the save after the one at kill_after, at a point of it chosen by the seed: that
    # checkpoint is committed, the next one is not (a job faster than a watcher never outruns its kill).
    point = random.Random(seed + 1).choice(
        ["save.file_written", "save.before_manifest", "save.before_rename"]
    )
    job = _start(hurt, hurt / "out", fault=f"kill:{point}@{kill_after + 20}")
    job.wait(timeout=300)
    assert job.returncode == -signal.SIGKILL, job.stdout.read() if job.stdout else ""
    assert not (hurt / "out").exists(), f"the job finished before it was killed (seed {seed})"
    cat = Catalog(f"sqlite:///{hurt / 'catalog.db'}")
    done_steps = [c.step for c in lineage.checkpoints(cat, "demo") if c.status != CheckpointStatus.WRITING]
    assert max(done_steps) == kill_after, f"seed {seed}"
    again = _start(hurt, hurt / "out")
    said, _ = again.communicate(timeout=300)
    assert again.returncode == 0, said
    assert "resumed demo after step" in said, said
    a, b = (
        load_file(str(plain / "out" / "final.safetensors")),
        load_file(str(hurt / "out" / "final.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"seed {seed}"
