"""Warm relaunch: a standby interpreter that already imported the job's modules takes over the relaunch.

Under protect-training with ``warm=True`` the example job (real tiny_lm, real Prefect flows) gets a
standby once it runs; SIGKILLed after step 25, recover-training hands the relaunch to that standby (the
launch records it), and the job ends bit-exact with an uninterrupted run. The standby itself: a launch is
handed over only to a standby made for the same command and an environment differing only in per-launch
variables (else the supervisor starts cold); the job's output and exit status come back to the
supervisor; a job whose standby is killed is killed with it (nothing runs on unwatched)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rewind.examples.tiny_lm import command
from rewind.infra.catalog import incidents, jobs
from rewind.infra.catalog.db import Catalog
from rewind.infra.launch import warm
from tests.prefect_support import wait_until
from tests.trainproc import REPO, assert_same_weights

JOB = (
    "import os, sys, time\n"
    "import json\n"  # an import the standby does ahead
    "import helper\n"  # the job's own module, beside it
    "print('job', os.getpid(), os.environ.get('X'), os.environ.get('REWIND_LAUNCH_ID'), sys.argv[1:], flush=True)\n"
    "print('to stderr', file=sys.stderr, flush=True)\n"
    "if os.environ.get('REWIND_LAUNCH_ID') == 'sleep': time.sleep(60)\n"
    "sys.exit(int(os.environ.get('CODE', '0')))\n"
)


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict[str, str]]:
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "helper.py").write_text("VALUE = 1\n")
    cmd = [sys.executable, str(tmp_path / "job.py"), "a", "b"]
    env = {**os.environ, "X": "1", "CODE": "3"}
    warm.start("w", 0, cmd, str(tmp_path), env)
    assert warm.wait_ready("w", 0, cmd, env, 60), (tmp_path / "home" / "standby" / "w-node0.log").read_text()
    yield cmd, env
    warm.stop("w", 0)


def _handed(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[warm.Handed | None, Any]:
    r, w = os.pipe()
    try:
        handed = warm.handoff("w", 0, cmd, str(cwd), env, w)
    finally:
        os.close(w)
    return handed, os.fdopen(r)


def test_a_standby_runs_a_launch_handed_to_it_and_reports_its_output_and_exit(script, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cmd, env = script
    handed, out = _handed(cmd, {**env, "REWIND_LAUNCH_ID": "7"}, tmp_path)  # a per-launch variable differs
    assert handed is not None
    assert handed.wait(30) == 3 and handed.poll() == 3
    text = out.read()
    assert f"job {handed.pid} 1 7 ['a', 'b']" in text and "to stderr" in text, text
    again, out2 = _handed(cmd, env, tmp_path)  # the standby outlives each launch
    assert again is not None and again.pid != handed.pid and again.wait(30) == 3
    out2.close()


def test_a_standby_made_for_another_environment_is_not_used(script, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cmd, env = script
    handed, out = _handed(cmd, {**env, "X": "2"}, tmp_path)  # a job variable differs: imports may differ
    out.close()
    assert handed is None
    assert wait_until(lambda: not warm.answering("w", 0) or None, 10, "the stale standby quits")


def test_a_standby_whose_job_code_was_edited_is_not_used(script, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cmd, env = script
    helper = tmp_path / "helper.py"
    helper.write_text("VALUE = 2  # a fix\n")
    os.utime(helper, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # a newer mtime, whatever the clock
    handed, out = _handed(cmd, env, tmp_path)
    out.close()
    assert handed is None  # a cold start reads the fix; the old copy in the standby is never run
    assert wait_until(lambda: not warm.answering("w", 0) or None, 10, "the stale standby quits")


def test_a_job_whose_standby_dies_dies_with_it(script, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cmd, env = script
    handed, out = _handed(cmd, {**env, "REWIND_LAUNCH_ID": "sleep"}, tmp_path)
    assert handed is not None
    wait_until(lambda: "job" in (out.readline() or "") or None, 30, "the job started")
    os.kill(_ppid(handed.pid), signal.SIGKILL)  # the job's parent: its standby
    assert handed.wait(30) == -9
    wait_until(
        lambda: not Path(f"/proc/{handed.pid}").exists() or _zombie(handed.pid) or None, 10, "the job gone"
    )


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(300)
def test_a_crashed_job_comes_back_warm_from_its_standby_bit_exact(
    prefect_api: str,
    rewind_env: dict[str, str],
    reference: Any,
    run_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rewind.flows.training import protect_training, recover_training, summary

    # the job waits in its step-30 save (once: the relaunch passes) until the test has seen the standby
    # answer and killed it: on a slow machine the 60 steps could end before the standby has imported torch
    monkeypatch.setenv("REWIND_FAULT", "hold:save.before_catalog@30")
    monkeypatch.setenv("REWIND_FAULT_ONCE", str(tmp_path / "fired"))
    monkeypatch.setenv("REWIND_FAULT_RELEASE", str(tmp_path / "release"))
    cat, out = Catalog(), tmp_path / "out"
    cmd = command(run_name, out, steps=60, every=10, extra=["--step-time-s", "0.05"])
    result: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(
            summary(protect_training(run_name, cmd, str(REPO), warm=True, return_state=True))
        )
    )
    t.start()
    wait_until(lambda: (tmp_path / "release.held").exists() or None, 120, "the job held at step 30")
    wait_until(lambda: warm.answering(run_name, 0) or None, 120, "the standby answers")
    pid = wait_until(lambda: _pid_past(cat, run_name, 25), 120, "the job past step 25", interval=0.1)
    os.kill(pid, signal.SIGKILL)
    t.join(timeout=120)
    assert result["status"] == "crash", result
    first = jobs.launches(cat, run_name)[0]
    assert first.handoff["warm"] == [False]  # the first launch starts cold and makes the standby

    began = time.monotonic()
    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered
    relaunch = jobs.launches(cat, run_name)[-1]
    assert relaunch.handoff["warm"] == [True], relaunch.handoff  # taken over by the standby
    assert_same_weights(out / "final.safetensors", reference[1])
    inc = incidents.get_incident(cat, result["incident_id"])
    print(
        f"warm relaunch: rebuild_s {inc.rebuild_s} rto_s {inc.rto_s}; recovery {time.monotonic() - began:.1f}s"
    )
    wait_until(lambda: not warm.answering(run_name, 0) or None, 30, "the standbys of a finished run quit")


def _pid_past(cat: Catalog, run: str, step: int) -> int | None:
    try:
        launches = jobs.launches(cat, run)
    except Exception:  # the run is not in the catalog yet
        return None
    rows = jobs.progress(cat, launches[-1].id) if launches else []
    return rows[0].pid if rows and (rows[0].step or 0) >= step else None
