"""Every launch smoke-tests its process group before the first step: a relaunch whose group fails it
(injected for real through the fault seam: rank 1's all-reduce raises) is an incident located at the
rebuild, recovered at the same size; the relaunch that works records its topology rebuild time (launch
to every rank's group ready)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from rewind.infra.catalog import incidents
from rewind.infra.catalog.db import Catalog
from tests.test_protect_any_job import config, protect, ranks_at


@pytest.mark.timeout(600)
def test_a_relaunch_whose_group_fails_its_smoke_test_is_a_rebuild_failure_recovered_at_the_same_size(
    prefect_api: str, rewind_env: dict[str, str], run_name: str, tmp_path: Path
) -> None:
    from rewind.flows.training import recover_training, summary

    fired = tmp_path / "fired"
    fired.touch()  # the fault is spent until the test removes this: the first launch runs clean
    env = {"OMP_NUM_THREADS": "1", "REWIND_FAULT": "eio:group.smoke%1", "REWIND_FAULT_ONCE": str(fired)}
    t, result = protect(run_name, config(tmp_path, run_name, step_time_s=0.1), env=env, min_world_size=2)
    os.kill(ranks_at(run_name, 12)[1], signal.SIGKILL)
    t.join(timeout=300)
    assert result["status"] == "crash", result

    fired.unlink()  # the relaunch's rank 1 now fails the smoke test, once
    second = summary(recover_training(result["incident_id"], return_state=True))
    cat = Catalog()
    broken = incidents.get_incident(cat, second["incident_id"])
    assert broken.details["failed_phase"] == "rebuild", broken.details
    assert broken.reason.startswith("the rebuild failed: rank 1: the process group failed its smoke test"), (
        broken.reason
    )

    recovered = summary(recover_training(broken.id, return_state=True))
    assert recovered["status"] == "recovered", recovered
    broken = incidents.get_incident(cat, broken.id)
    assert broken.decision.startswith("restart with the same layout"), broken.decision  # it cost no devices
    ready = broken.details["group_ready_s"]
    assert ready is not None and 0 < ready <= broken.rebuild_s, (ready, broken.rebuild_s)
