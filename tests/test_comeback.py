"""The comeback watched: after a restore the relaunch's losses are compared with the same steps' losses
before the failure (rank 0 keeps its newest 100 with its progress; the recovery hands the ones past the
restore point over). A bit-exact resume matches every step and the incident says so; a comeback that is
not what the run was (the test job's learning rate multiplied after a restore) is flagged as an anomaly at
the step it diverged, and the recovery records it."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from rewind.infra.catalog import incidents, jobs
from rewind.infra.catalog.db import Catalog
from tests.prefect_support import wait_until
from tests.test_protect_any_job import config, protect

# Progress rows come once a second: the kill lands up to a second's steps (about 10 here) past the one
# asked for. Checkpoints 40 steps apart, the kill asked for at 50: it lands well before the next one,
# with steps past the restore point to compare (killed just after a checkpoint, none would be left).
STEPS, EVERY, KILL_AT, STEP_S = 100, 40, 50, 0.1


def _killed_after(run: str, step: int, cfg: Path) -> dict[str, Any]:
    """The single-process job under protect-training, SIGKILLed once past ``step``."""
    t, result = protect(run, cfg, nproc_per_node=1)
    cat = Catalog()

    def pid() -> int | None:
        try:
            launch = jobs.launches(cat, run)[-1]
        except Exception:  # not in the catalog yet
            return None
        rows = jobs.progress(cat, launch.id)
        return rows[0].pid if rows and (rows[0].step or 0) >= step else None

    os.kill(wait_until(pid, 120, f"step {step}", interval=0.1), signal.SIGKILL)
    t.join(timeout=120)
    assert result["status"] == "crash", result
    return result


@pytest.mark.timeout(300)
def test_a_bit_exact_comeback_matches_every_step_before_the_failure(
    prefect_api, rewind_env, run_name, tmp_path
):  # type: ignore[no-untyped-def]
    from rewind.flows.training import recover_training, summary

    cfg = config(tmp_path, run_name, steps=STEPS, step_time_s=STEP_S, checkpoint_every=EVERY)
    result = _killed_after(run_name, KILL_AT, cfg)
    assert summary(recover_training(result["incident_id"], return_state=True))["status"] == "recovered"
    came = incidents.get_incident(Catalog(), result["incident_id"]).details["comeback"]
    assert came["compared"] >= 8 and came["identical"] == came["compared"], came  # replayed, step for step
    assert came["max_rel_deviation"] == 0 and came["diverged_at"] is None and came["same_layout"], came


@pytest.mark.timeout(300)
def test_a_comeback_that_diverges_is_an_anomaly_recorded_on_the_incident(
    prefect_api, rewind_env, run_name, tmp_path
):  # type: ignore[no-untyped-def]
    from rewind.flows.training import recover_training, summary

    cfg = config(tmp_path, run_name, steps=STEPS, step_time_s=STEP_S, checkpoint_every=EVERY, diverge_lr=50.0)
    result = _killed_after(run_name, KILL_AT, cfg)
    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "failed-again", recovered
    cat = Catalog()
    came = incidents.get_incident(cat, result["incident_id"]).details["comeback"]
    assert came["diverged_at"] is not None and came["max_rel_deviation"] > came["tolerance"], came
    again = incidents.get_incident(cat, recovered["incident_id"])
    assert again.kind == "loss_spike" and "the comeback diverged at step" in again.reason, again.reason


def test_on_a_new_layout_only_a_blown_up_loss_is_a_divergence() -> None:
    from rewind.infra.training.comeback import RESHAPED_MIN_STEPS, Comeback

    before = {s: 1.0 for s in range(1, 31)}
    shifted = Comeback(dict(before), same_layout=False)  # other samples on rank 0: half, then twice the loss
    assert all(shifted.observe(s, 0.5 if s % 2 else 2.0) is None for s in range(1, 31))
    assert shifted.diverged_at is None and shifted.compared == 30

    blown = Comeback(dict(before), same_layout=False)
    reasons = [blown.observe(s, 5.0) for s in range(1, 31)]
    assert blown.diverged_at == RESHAPED_MIN_STEPS and "new layout" in (reasons[RESHAPED_MIN_STEPS - 1] or "")

    negative = Comeback({s: -1.0 for s in range(1, 31)}, same_layout=False)  # a log-likelihood
    assert all(negative.observe(s, -0.2) is None for s in range(1, 31))
    nan = Comeback(dict(before), same_layout=False)
    assert [nan.observe(s, float("nan")) for s in range(1, RESHAPED_MIN_STEPS + 1)][-1] is not None


def test_the_losses_kept_for_a_comeback_leave_out_nan_and_inf() -> None:
    import json

    from rewind.infra.training.comeback import RecentLosses

    kept = RecentLosses(kept=3)
    for step, loss in [(1, 1.0), (2, float("nan")), (3, float("inf")), (4, 0.5), (5, 0.25), (6, 0.125)]:
        kept.add(step, loss)
    assert kept.as_dict() == {"4": 0.5, "5": 0.25, "6": 0.125}
    json.dumps(kept.as_dict(), allow_nan=False)  # what Postgres's JSON accepts
