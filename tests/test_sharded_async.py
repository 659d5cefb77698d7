"""Async multi-rank saves (torchrun, gloo): each rank stages, training goes on, each rank persists and hashes
in the background, and rank 0 commits only once every rank reported. A rank SIGKILLed in the middle of its
background persist leaves nothing committed, and the job started again resumes from the checkpoint before,
ending bit-identical to a run never interrupted. The values at the call are what is saved (copy-safe: with
the staging shells made at the save, ddp, and prepared beforehand, fsdp2), and a restore waits for a save
still in flight."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.states import CheckpointStatus as S
from tests.torchrun_support import torchrun

REPO = Path(__file__).resolve().parents[1]


def _env(home: Path, fault: str = "") -> dict[str, str]:
    return {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": "",
            "OMP_NUM_THREADS": "1", "REWIND_FAULT": fault}  # fmt: skip


def _job(home: Path, fault: str = "") -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "rewind.examples.tiny_lm_ddp", "--run", "job", "--steps", "30",
           "--checkpoint-every", "10", "--out", str(home / "out"), "--nproc", "2", "--async-save"]  # fmt: skip
    return subprocess.run(cmd, cwd=home, env=_env(home, fault), capture_output=True, text=True, timeout=300)


def test_a_rank_killed_in_its_background_persist_commits_nothing_and_the_job_resumes_bit_exact(
    tmp_path: Path,
) -> None:
    plain, hurt = tmp_path / "plain", tmp_path / "hurt"
    for d in (plain, hurt):
        d.mkdir()
    done = _job(plain)
    assert done.returncode == 0, done.stderr[-3000:]
    # Rank 1 dies after its share of step 20 is written, in the background thread, before any commit.
    first = _job(hurt, fault="kill:save.shard_written@20%1")
    assert first.returncode != 0, first.stderr[-3000:]
    cat = Catalog(f"sqlite:///{hurt / 'catalog.db'}")
    states = {c.step: S(c.status) for c in lineage.checkpoints(cat, "job")}
    assert states.get(10) in (S.COMMITTED, S.VERIFIED), states
    assert states.get(20) in (None, S.WRITING, S.ABORTED), states  # never committed
    run_dir = Path(lineage.checkpoints(cat, "job", 10)[-1].path).parent
    assert (run_dir / "step-10").is_dir() and not (run_dir / "step-20").exists()
    again = _job(hurt)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed run job at step 10" in again.stderr, again.stderr[-3000:]
    a, b = (
        load_file(str(plain / "out" / "final.safetensors")),
        load_file(str(hurt / "out" / "final.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_an_async_sharded_save_holds_the_values_of_the_call_and_a_restore_waits_for_it(
    kind: str, tmp_path: Path
) -> None:
    done = subprocess.run([*torchrun(2), "-m", "tests.async_sharded_worker", kind, str(tmp_path)], cwd=REPO,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=180)  # fmt: skip
    said = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert done.returncode == 0 and len(said) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert all("copy-safe step 7" in line for line in said), said
    # the ranks' files, written by Rewind's own writer, read by DCP's alone (no Rewind, no process group)
    dcp_to_torch_save(tmp_path / "copysafe" / "step-7", tmp_path / "by-dcp.pt")
    loaded = torch.load(tmp_path / "by-dcp.pt", weights_only=True)
    assert {k for k in loaded if k.startswith("s.model.")} == {
        f"s.model.{i}.{w}" for i in (0, 1) for w in ("weight", "bias")
    }


def test_rank_0s_catalog_failing_reaches_every_rank_and_the_next_save_is_whole(tmp_path: Path) -> None:
    env = {**_env(tmp_path), "REWIND_FAULT": "eio:save.before_catalog@7"}
    done = subprocess.run([*torchrun(2), "-m", "tests.async_sharded_worker", "ddp", str(tmp_path), "leadfails"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    said = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert done.returncode == 0 and len(said) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert all("heard rank 0 before any rank wrote; restored step 8" in line for line in said), said


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_rank_unable_to_save_fails_the_save_on_every_rank_at_once_and_the_next_save_is_whole(
    mode: str, tmp_path: Path
) -> None:
    """Rank 1's own state holds a value no checkpoint holds (a set): rank 0's share is fine. Every rank hears it
    from that save, at once, none waiting in DCP's collectives for the rank that never entered them (the
    group's timeout is 90 s; the test's 150 s)."""
    cmd = [*torchrun(2), "-m", "tests.async_sharded_worker", "ddp", str(tmp_path), "onefails", mode]
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=150)
    said = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert done.returncode == 0 and len(said) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert all("heard rank 1's state; restored step 8" in line for line in said), said
    states = {
        c.step: S(c.status)
        for c in lineage.checkpoints(Catalog(f"sqlite:///{tmp_path / 'catalog.db'}"), "onefails")
    }
    assert states.get(7) in (None, S.ABORTED) and states[8] in (S.COMMITTED, S.VERIFIED), states
