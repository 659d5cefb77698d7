"""`rewind status` through the real executable against a real Postgres catalog built by the real engines:
checkpoints saved and deep-verified, replicated to a shared tier (which then lags), progress reported by a
rank, an open incident, a served version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rewind.infra.catalog import copies, incidents, jobs, lineage, serving
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.replication import replicate
from rewind.infra.restore.scrub import scrub
from rewind.infra.tiers import open_tier

REWIND = str(Path(sys.executable).parent / "rewind")


@pytest.fixture
def catalog_state(rewind_env, run_name, tmp_path):
    cat = Catalog()
    ck = Checkpointer(run_name, states={"model": torch.nn.Linear(4, 4)}, catalog=cat)
    for step in (10, 20):
        ck.save(step)
    (tmp_path / "shared").mkdir()  # a mounted shared path
    shared = open_tier(str(tmp_path / "shared"))
    for c in lineage.checkpoints(cat, run_name):
        scrub(cat, c, deep=True)
    for c in copies.without_copy(cat, shared.name, shared.uri, run_name):
        replicate(cat, c, shared)
    ck.save(30)  # verified locally, not yet replicated: the shared tier lags by 10 steps
    scrub(cat, lineage.checkpoints(cat, run_name, 30)[0], deep=True)
    ck.save(40)  # committed, not verified yet
    launch = jobs.begin_launch(cat, run_name, {"command": ["train"]}, {"world_size": 1})
    newest = lineage.checkpoints(cat, run_name, 30)[0]
    made = newest.created_at.timestamp()
    jobs.report(cat, launch, 0, node="n0", pid=os.getpid(), step=47, step_at=made + 12.5, beat_at=made + 13)
    inc = incidents.open_incident(cat, run_name, "hang", "rank 0 on n0 made no progress after step 47")
    c20 = lineage.checkpoints(cat, run_name, 20)[0]
    serving.add_version(
        cat, model=f"m-{run_name[-6:]}", version="1", checkpoint_id=c20.id, run=run_name, step=20,
        manifest_digest=c20.manifest_digest, artifact_uri="file:///m.mar", artifact_digest="0" * 64,
        artifact_bytes=1, state="stable", weight=100, was_stable=True,
    )  # fmt: skip
    return {"incident": inc, "launch": launch, "shared": shared.name}


def _rewind(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([REWIND, *args], env=os.environ, capture_output=True, text=True, timeout=120)


def test_status_of_a_run_as_json(catalog_state, run_name):
    done = _rewind("status", run_name, "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    (run,) = got["runs"]
    assert run["run"] == run_name
    assert run["newest_verified"]["step"] == 30 and run["newest_verified"]["age_s"] >= 0
    assert run["newest_unverified"]["step"] == 40
    assert run["verified_checkpoints"] == 3
    assert run["rpo"]["steps"] == 17 and run["rpo"]["to_step"] == 47
    assert run["rpo"]["seconds"] == pytest.approx(12.5, abs=0.01)
    assert run["job"]["launch_id"] == catalog_state["launch"] and run["job"]["running"]
    assert run["job"]["processes"] == [{"rank": 0, "node": "n0", "pid": os.getpid()}]  # what to kill by hand
    local, shared = run["tiers"]["local"], run["tiers"][catalog_state["shared"]]
    assert (local["verified_copies"], local["newest_verified_step"], local["lag_steps"]) == (3, 30, 0)
    assert (shared["verified_copies"], shared["newest_verified_step"], shared["lag_steps"]) == (2, 20, 10)
    assert shared["lag_s"] >= 0 and shared["bytes"] > 0
    (inc,) = run["open_incidents"]
    assert inc["id"] == catalog_state["incident"] and inc["kind"] == "hang"
    (model,) = got["models"]
    (v,) = model["versions"]
    assert (v["version"], v["state"], v["weight"], v["step"], v["checkpoint_status"]) == (
        "1",
        "stable",
        100,
        20,
        "verified",
    )

    text = _rewind("status", run_name)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "newest verified   step 30" in out and "17 steps lost" in out, out
    assert "lag 10 steps" in out and "hang" in out and "weight 100" in out, out
    assert f"processes         rank 0 pid {os.getpid()} on n0" in out, out


def test_status_of_a_run_whose_job_ended_puts_nothing_at_risk(catalog_state, run_name):
    """Steps past the newest verified one are not "lost" once the job is over (a finished run, or one rolled
    back): nothing runs that could lose them."""
    jobs.end_launch(Catalog(), catalog_state["launch"], 0)
    out = _rewind("status", run_name).stdout
    assert "nothing is at risk: the job is not running; its newest reported step was 47" in out, out
    assert "steps lost" not in out and "ended, exit 0" in out, out
    assert "processes" not in out, out  # nothing left to kill


def test_status_of_an_unknown_run_is_one_line_and_exit_2(rewind_env):
    done = _rewind("status", "no-such-run")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "no run named 'no-such-run'" in done.stderr
