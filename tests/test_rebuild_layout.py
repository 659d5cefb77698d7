"""The rebuild plans the relaunch's TP x PP x DP from what the run recorded, not from a constant."""

from __future__ import annotations

import pytest

from rewind.infra.errors import ConfigError
from rewind.infra.health.layout import Layout, ModelShape
from rewind.infra.launch import rebuild
from rewind.infra.launch.spec import JobSpec

SHAPE = ModelShape(heads=4, hidden=32, layers=2)


def _spec(**kw: object) -> JobSpec:
    return JobSpec(command=("python", "-m", "job"), nproc_per_node=4, global_batch=16, lr=0.01, **kw)  # type: ignore[arg-type]


def test_a_crash_of_a_tp2_dp2_job_keeps_tp2_as_the_restore_point_recorded_it():
    full = _spec()  # the spec says nothing of TP: only the checkpoint knows it
    rec = rebuild.Recorded(saved=Layout(tp=2, pp=1, dp=2), shape=SHAPE)
    r = rebuild.plan(full, full, "crash", lost_node=None, shrink=True, recorded=rec)
    assert (r.before, r.after) == (Layout(2, 1, 2), Layout(2, 1, 1))
    assert r.spec.nproc_per_node == 2 and r.spec.layout == {"tp": 2, "pp": 1}
    assert r.handoff["layout"] == {"world_size": 2, "tp": 2, "pp": 1, "dp": 1}
    assert r.handoff["global_batch"] == 8 and r.handoff["lr_scale"] == 0.5
    assert "as TP2 x PP1 x DP1" in r.decision and "kept TP" in r.decision
    # The same crash with nothing recorded: data-parallel on the 3 devices left, and the decision says why.
    dp_only = rebuild.plan(full, full, "crash", lost_node=None, shrink=True)
    assert dp_only.after == Layout(1, 1, 3) and "no model shape reported" in dp_only.decision


def test_the_layout_handed_to_the_failed_launch_counts_when_the_checkpoint_has_none():
    full = _spec(layout={"tp": 2, "pp": 1})
    rec = rebuild.Recorded(handed=Layout(tp=2, pp=1, dp=2))
    r = rebuild.plan(full, full, "crash", lost_node=None, shrink=True, recorded=rec)
    assert r.after == Layout(2, 1, 1)  # no shape: the old TP is known to fit


def test_a_hang_restarts_on_the_same_layout():
    full = _spec()
    rec = rebuild.Recorded(saved=Layout(tp=2, pp=1, dp=2), shape=SHAPE)
    r = rebuild.plan(full, full, "hang", lost_node=None, shrink=True, recorded=rec)
    assert r.after == r.before == Layout(2, 1, 2) and r.decision.startswith("restart with the same layout")


def test_a_spec_layout_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError, match="must divide the world size 4"):
        _spec(layout={"tp": 3, "pp": 1})
    with pytest.raises(ConfigError, match="layout must give tp and pp"):
        _spec(layout={"tp": 2})


def test_a_job_whose_loader_keeps_per_rank_state_comes_back_on_as_many_ranks():
    full = _spec()
    rec = rebuild.Recorded(saved=Layout(tp=1, pp=1, dp=4), same_world=True)
    r = rebuild.plan(full, full, "crash", lost_node=None, shrink=True, recorded=rec)
    assert r.after == Layout(1, 1, 4) and r.spec.nproc_per_node == 4
    assert "per-rank state: the same number of ranks" in r.decision, r.decision
