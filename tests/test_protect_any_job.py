"""Any job written against the session API is protected end to end by the flows: a rank killed, a rank
hung, a NaN from a bad sample; each detected without reading the job's output, recovered, and (where the
incident allows) finished bit-identical to an uninterrupted run. The job is examples/any_job.py: its own
JSON config and log format, two gloo ranks under torchrun started from the run's job spec."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from rewind.infra.catalog import incidents, jobs
from rewind.infra.catalog.db import Catalog
from rewind.infra.training.data import epoch_order
from tests.prefect_support import wait_until
from tests.torchrun_support import torchrun
from tests.trainproc import REPO, assert_same_weights

STEPS, EVERY, BATCH = 40, 10, 16


def config(path: Path, run: str, **extra: Any) -> Path:
    cfg = {"run": run, "steps": STEPS, "checkpoint_every": EVERY, "batch": BATCH, "lr": 0.01, "seed": 0,
           "out": str(path / "out"), **extra}  # fmt: skip
    file = path / "job.json"
    file.write_text(json.dumps(cfg))
    return file


def command(cfg: Path) -> list[str]:
    return ["python", "examples/any_job.py", str(cfg)]  # no Rewind flag, no Rewind log format


@pytest.fixture(scope="module")
def reference(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The same job, two ranks, uninterrupted and unsupervised (its own SQLite catalog)."""
    home = tmp_path_factory.mktemp("ref")
    cfg = config(home, "reference")
    env = {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": "",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [*torchrun(2), "examples/any_job.py", str(cfg)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return home / "out" / "final.safetensors"


def protect(run: str, cfg: Path, **spec: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """protect-training in a thread, so the test can hurt the job while it runs."""
    from rewind.flows.training import protect_training, summary

    result: dict[str, Any] = {}
    kw = {"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}, **spec}
    t = threading.Thread(
        target=lambda: result.update(
            summary(protect_training(run, command(cfg), str(REPO), **kw, return_state=True))
        )
    )
    t.start()
    return t, result


def ranks_at(run: str, step: int) -> dict[int, int]:
    """Wait until every rank of the newest launch passed ``step``; their pids by rank."""
    cat = Catalog()

    def probe() -> dict[int, int] | None:
        ls = jobs.launches(cat, run) if _has_run(cat, run) else []
        rows = jobs.progress(cat, ls[-1].id) if ls else []
        return (
            {r.rank: r.pid for r in rows}
            if len(rows) == 2 and all((r.step or 0) >= step for r in rows)
            else None
        )

    return wait_until(probe, 180, f"both ranks past step {step}", interval=0.2)


def _has_run(cat: Catalog, run: str) -> bool:
    from rewind.infra.catalog import lineage

    try:
        lineage.get_run(cat, run)
    except Exception:
        return False
    return True


def test_a_killed_rank_is_recovered_bit_exact(prefect_api, rewind_env, reference, run_name, tmp_path):
    from rewind.flows.training import recover_training, summary

    t, result = protect(run_name, config(tmp_path, run_name, step_time_s=0.1), min_world_size=2)
    pids = ranks_at(run_name, 12)
    os.kill(pids[1], signal.SIGKILL)  # a rank dies (its device is gone, its peers are left waiting)
    t.join(timeout=300)
    assert result["status"] == "crash", result
    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered
    inc = incidents.get_incident(Catalog(), result["incident_id"])
    assert inc.decision.startswith("restart with the same layout")  # min_world_size 2: no rank to lose
    assert_same_weights(tmp_path / "out" / "final.safetensors", reference)


def test_a_hung_rank_is_detected_and_recovered(prefect_api, rewind_env, reference, run_name, tmp_path):
    from rewind.flows.training import recover_training, summary

    timeout = 5.0
    t, result = protect(run_name, config(tmp_path, run_name, step_time_s=0.1), heartbeat_timeout_s=timeout)
    pids = ranks_at(run_name, 12)
    os.kill(pids[1], signal.SIGSTOP)  # a rank stops: no exit, no output, nothing but silence
    t.join(timeout=300)
    assert result["status"] == "hang", result
    inc = incidents.get_incident(Catalog(), result["incident_id"])
    assert timeout <= inc.detection_s <= timeout + 3.0, inc.detection_s  # poll 1 s + heartbeat 1 s
    assert 1 in inc.details["hang"]["ranks"]
    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered
    assert_same_weights(tmp_path / "out" / "final.safetensors", reference)


def test_nan_rolls_back_and_the_bad_window_is_skipped(prefect_api, rewind_env, run_name, tmp_path):
    from rewind.examples.any_job import Regression
    from rewind.flows.training import recover_training, summary

    order = epoch_order(len(Regression()), 0, 0).tolist()
    poison = order[12 * 2 * BATCH + 3]  # global position 387: step 13
    log = tmp_path / "samples"
    log.mkdir()
    cfg = config(tmp_path, run_name, poison=poison, sample_log=str(log))
    t, result = protect(run_name, cfg)
    t.join(timeout=300)
    assert result["status"] == "nan", result
    for f in log.glob("rank-*.log"):
        f.rename(f.with_suffix(".first"))  # keep the relaunch's log apart
    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered" and recovered["restored_step"] == 10, recovered
    inc = incidents.get_incident(Catalog(), result["incident_id"])
    assert inc.kind == "nan" and inc.details["bad_step"] == 13
    assert inc.details["skipped_samples"] == [320, 416] and inc.details["skipped_steps"] == [11, 13]
    after = [json.loads(x) for f in log.glob("rank-*.log") for x in f.read_text().splitlines()]
    assert sorted({r["step"] for r in after}) == list(range(11, STEPS + 1))
    seen = [s for r in after for s in r["samples"]]
    assert poison not in seen and not set(seen) & set(order[320:416])
    assert sorted(seen) == sorted(
        order[416 : 416 + (STEPS - 10) * 2 * BATCH]
    )  # nothing else skipped or repeated
