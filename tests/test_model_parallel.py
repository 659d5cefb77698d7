"""Model-parallel elasticity on real processes (torchrun, gloo): a tensor-parallel x data-parallel job
(examples/tp_lm.py: DTensor TP, FSDP2 over DP) loses a rank and comes back on the layout the planner
chose from the restore point's record, its parameters and optimizer state resharded exactly."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rewind.examples.runner import TrainingProcess
from rewind.infra.catalog import incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.health.layout import ENV as LAYOUT_ENV
from rewind.infra.health.layout import Layout, ModelShape
from rewind.infra.launch import rebuild
from rewind.infra.launch.spec import JobSpec
from tests.prefect_support import wait_until
from tests.trainproc import REPO

STEPS, EVERY, MICRO, LR = 30, 10, 8, 3e-3


def command(
    run: str, *, tp: int = 2, pp: int = 1, steps: int = STEPS, nproc: int = 4, python: str = "python"
) -> list[str]:
    return [
        python, "-m", "rewind.examples.tp_lm", "--run", run, "--steps", str(steps), "--checkpoint-every",
        str(EVERY), "--tp", str(tp), "--pp", str(pp), "--nproc", str(nproc), "--batch-size", str(MICRO),
        "--step-time-s", "0.1",
    ]  # fmt: skip


def assert_same_state(dumps: Path, step: int, stages: int = 1) -> None:
    """The full (gathered) model and optimizer state after the restore equals what was saved, bit for bit;
    saved by pipeline stages, the union of what each stage held."""
    if stages > 1:
        saved = {
            k: v
            for r in range(stages)
            for k, v in load_file(str(dumps / f"saved-{step}-rank{r}.safetensors")).items()
        }
    else:
        saved = load_file(str(dumps / f"saved-{step}.safetensors"))
    restored = load_file(str(dumps / f"restored-{step}.safetensors"))
    assert saved.keys() == restored.keys() and sum(k.startswith("optim/") for k in saved) > 10
    for k in saved:
        assert torch.equal(saved[k], restored[k]), k


def _ranks_past(run: str, step: int, ranks: int) -> dict[int, int]:
    cat = Catalog()

    def probe() -> dict[int, int] | None:
        try:
            ls = jobs.launches(cat, run)
        except Exception:
            return None
        rows = jobs.progress(cat, ls[-1].id) if ls else []
        done = len(rows) == ranks and all((r.step or 0) >= step for r in rows)
        return {r.rank: r.pid for r in rows} if done else None

    return wait_until(probe, 240, f"{ranks} ranks past step {step}", interval=0.2)


def test_a_tp2_dp2_job_losing_a_rank_comes_back_as_tp2_dp1_resharded_exactly(
    prefect_api, rewind_env, run_name, tmp_path
):
    from rewind.flows.training import protect_training, recover_training, summary

    dumps = tmp_path / "dumps"
    env = {"OMP_NUM_THREADS": "1", "TINY_LM_DUMP_DIR": str(dumps)}
    result: dict[str, Any] = {}
    spec: dict[str, Any] = {"nproc_per_node": 4, "global_batch": 2 * MICRO, "lr": LR, "env": env}  # no layout
    t = threading.Thread(
        target=lambda: result.update(
            summary(protect_training(run_name, command(run_name), str(REPO), **spec, return_state=True))
        )
    )
    t.start()
    pids = _ranks_past(run_name, EVERY + 2, 4)
    os.kill(pids[1], signal.SIGKILL)  # a rank's device is gone
    t.join(timeout=300)
    assert result["status"] == "crash", result
    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered

    cat = Catalog()
    inc = incidents.get_incident(cat, result["incident_id"])
    assert (inc.layout_before, inc.layout_after) == (
        {"world_size": 4, "tp": 2, "pp": 1, "dp": 2},
        {"world_size": 2, "tp": 2, "pp": 1, "dp": 1},
    ), inc.decision
    assert "kept TP" in inc.decision and "global batch 16 -> 8" in inc.decision, inc.decision
    resumed = inc.details["resumed_at_step"]
    assert resumed >= EVERY
    assert_same_state(dumps, resumed)
    # The relaunch built the mesh it was handed and recorded it with its checkpoints.
    last = lineage.checkpoints(cat, run_name)[-1]
    assert last.step == STEPS and Layout.from_dict(last.layout) == Layout(2, 1, 1)
    assert ModelShape.from_dict(last.layout["model"]) == ModelShape(heads=4, hidden=32, layers=2)
    # The loss after the restore against the same steps before the failure, on the new layout.
    came_back = inc.details["comeback"]
    assert came_back["same_layout"] is False and came_back["compared"] >= 1
    assert math.isfinite(came_back["mean_rel_deviation"])
    (lead,) = [r for r in jobs.progress(cat, jobs.launches(cat, run_name)[-1].id) if r.rank == 0]
    assert lead.step == STEPS and math.isfinite(lead.detail["losses"][str(STEPS)])


def _replanned_onto_one_rank(
    run_name: str,
    env: dict[str, str],
    first: list[str],
    saved_as: Layout,
    spec: JobSpec,
    why: str,
    stages: int,
) -> None:
    """Run ``first`` to the step-EVERY checkpoint; the planner, fed the layout and shape that checkpoint
    recorded, plans one rank (``why`` in its decision); resumed on that layout, the restored state equals
    the saved one exactly."""
    done = TrainingProcess(first, cwd=REPO, env=env)
    assert done.finish(timeout=300) == 0, done.output.text[-3000:]
    (saved,) = lineage.checkpoints(Catalog(), run_name, step=EVERY)
    assert Layout.from_dict(saved.layout) == saved_as
    rec = rebuild.Recorded(
        saved=Layout.from_dict(saved.layout), shape=ModelShape.from_dict(saved.layout["model"])
    )
    r = rebuild.plan(spec, spec, "crash", lost_node=None, shrink=True, recorded=rec)
    assert r.after == Layout(1, 1, 1) and why in r.decision, r.decision
    handed = {**env, LAYOUT_ENV: r.after.env_value()}
    second = TrainingProcess(
        command(run_name, steps=EVERY + 2, nproc=1, python=sys.executable), cwd=REPO, env=handed
    )
    assert second.finish(timeout=300) == 0, second.output.text[-3000:]
    assert f"at step {EVERY} as TP1 x PP1 x DP1" in second.output.text
    assert_same_state(Path(env["TINY_LM_DUMP_DIR"]), EVERY, stages=stages)


def test_a_tp2_job_forced_onto_one_rank_changes_tp_and_reshards_exactly(rewind_env, run_name, tmp_path):
    env = {**rewind_env, "OMP_NUM_THREADS": "1", "TINY_LM_DUMP_DIR": str(tmp_path / "dumps")}
    first = command(run_name, steps=EVERY, nproc=2, python=sys.executable)
    spec = JobSpec(command=("python",), nproc_per_node=2, global_batch=MICRO, lr=LR)
    _replanned_onto_one_rank(
        run_name, env, first, Layout(2, 1, 1), spec, "TP 2 -> 1 (old TP does not fit)", 1
    )


def test_a_pp2_job_resumes_as_pp1_exactly(rewind_env, run_name, tmp_path):
    env = {**rewind_env, "OMP_NUM_THREADS": "1", "TINY_LM_DUMP_DIR": str(tmp_path / "dumps")}
    first = command(run_name, tp=1, pp=2, steps=EVERY, nproc=2, python=sys.executable)
    spec = JobSpec(command=("python",), nproc_per_node=2)
    # every stage's parameters and per-parameter Adam state
    _replanned_onto_one_rank(run_name, env, first, Layout(1, 2, 1), spec, "PP 2 -> 1", stages=2)
