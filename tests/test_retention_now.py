"""Retention keeps what restores now: a checkpoint verified earlier and damaged since (bit rot after its
last check) is not what older checkpoints are deleted on."""

from __future__ import annotations

from pathlib import Path

import torch

from rewind import Checkpointer
from rewind.flows.cli import main as rewind
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from tests.integrity_support import flip, statuses


def _saved(run: str, steps: range) -> dict[int, torch.Tensor]:
    """Checkpoints of a small model at ``steps``; its weights at each."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ck = Checkpointer(run=run, states={"model": model})
    held = {}
    try:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(step)
            held[step] = model.weight.detach().clone()
    finally:
        ck.close()
    return held


def test_gc_proves_the_checkpoints_it_keeps_at_that_moment(rewind_env: dict[str, str], run_name: str) -> None:
    weights = _saved(run_name, range(1, 4))
    assert rewind(["ckpt", "verify", run_name, "--deep"]) == 0  # all three proven, then step 3 rots
    (newest,) = lineage.checkpoints(Catalog(), run_name, 3)
    flip(next(Path(newest.path).glob("*.safetensors")))

    assert rewind(["gc", run_name, "--keep-last", "1", "--grace-days", "0"]) == 0
    assert statuses(run_name) == {1: "deleted", 2: "verified", 3: "corrupt"}

    fresh = torch.nn.Linear(64, 64)
    ck = Checkpointer(run=run_name, states={"model": fresh})
    try:
        got = ck.restore_latest()
    finally:
        ck.close()
    assert got is not None and got.step == 2
    assert torch.equal(fresh.weight, weights[2])
