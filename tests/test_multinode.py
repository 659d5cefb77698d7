"""Two nodes (two torchrun agents, c10d rendezvous, gloo, loopback): one node is lost with its ranks; the
job comes back on the node left, resharded, told its new size, global batch and learning rate, and no
sample is skipped or repeated."""

from __future__ import annotations

import json
import signal

from rewind.infra.catalog import incidents, jobs
from rewind.infra.catalog.db import Catalog
from rewind.infra.launch.process import pids_with_env, signal_all
from rewind.infra.training.data import epoch_order
from tests.test_protect_any_job import BATCH, STEPS, config, protect, ranks_at


def _lose_node(run: str, node: int) -> int:
    """SIGKILL every process of ``node`` in the run's current launch: its torchrun agent and its ranks."""
    launch = jobs.launches(Catalog(), run)[-1]  # found by its token: launch ids repeat across test catalogs
    pids = pids_with_env(REWIND_LAUNCH_TOKEN=launch.handoff["token"], REWIND_NODE=str(node))
    assert len(pids) >= 2, (
        pids
    )  # the agent and at least one rank (torchrun starts ranks in their own sessions)
    signal_all(pids, signal.SIGKILL)
    return len(pids)


def test_a_lost_node_comes_back_on_the_node_left(prefect_api, rewind_env, run_name, tmp_path):
    from rewind.examples.any_job import Regression
    from rewind.flows.training import recover_training, summary

    log = tmp_path / "samples"
    log.mkdir()
    cfg = config(tmp_path, run_name, sample_log=str(log), step_time_s=0.1)
    t, result = protect(run_name, cfg, nnodes=2, nproc_per_node=1, global_batch=2 * BATCH, lr=0.01)
    ranks_at(run_name, 12)
    _lose_node(run_name, 1)  # the node is gone: its agent and its rank with it
    t.join(timeout=300)
    assert result["status"] == "crash", result
    cat = Catalog()
    first = incidents.get_incident(cat, result["incident_id"])
    assert first.details["lost_node"] == 1

    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered
    inc = incidents.get_incident(cat, result["incident_id"])
    assert (inc.layout_before["dp"], inc.layout_after["dp"]) == (2, 1)
    assert "1 node(s) x 1" in inc.decision and "lr 0.01 -> 0.005" in inc.decision, inc.decision
    assert inc.details["handoff"]["lr_scale"] == 0.5 and inc.details["handoff"]["global_batch"] == BATCH
    # What the relaunched job received, and what it applied, in its own words (its progress row).
    (rank0,) = jobs.progress(cat, jobs.launches(cat, run_name)[-1].id)
    assert rank0.detail["received"]["lr_scale"] == 0.5 and rank0.detail["received"]["world_size"] == 1
    assert rank0.detail["applied"] == {"lr": 0.005, "world_size": 1, "global_batch": BATCH}

    resumed = inc.details["resumed_at_step"]
    assert resumed in (10, 20, 30)
    taken: list[int] = []
    for f in log.glob("rank-*.log"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if (r["world"] == 2 and r["step"] <= resumed) or (r["world"] == 1 and r["step"] > resumed):
                taken += r["samples"]
    order = epoch_order(len(Regression()), 0, 0).tolist()
    expected = order[: resumed * 2 * BATCH + (STEPS - resumed) * BATCH]
    assert sorted(taken) == sorted(expected), "a sample was skipped or repeated across the node loss"
