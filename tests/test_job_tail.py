"""The supervisor keeps the job's last lines, bounded, whatever the job prints."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time

import pytest

from rewind.infra.catalog import incidents, jobs
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills import servers
from rewind.infra.launch.node_process import TAIL_BYTES, TAIL_LINES, bounded_tail
from rewind.infra.launch.observe import Seen
from rewind.infra.launch.spec import JobSpec
from rewind.infra.launch.supervisor import Supervisor


def test_bounded_tail_keeps_the_newest_lines_that_fit_and_hides_url_credentials():
    lines = [f"line {i}" for i in range(100)] + ["fetching s3://key:topsecret@host/bucket"]
    got = bounded_tail(lines)
    assert len(got) == TAIL_LINES and got[-2] == "line 99" and "topsecret" not in got[-1]
    wide = bounded_tail(["x" * 3000, "y" * 3000])
    assert wide == ["y" * 3000]  # two do not fit 4 KiB: the newest one stays whole
    huge = bounded_tail(["a", "é" * 10_000])
    assert len(huge) == 1 and len(huge[0].encode()) <= TAIL_BYTES and huge[0].endswith("é")


def test_every_incident_kind_fits_the_kind_column():
    assert "failed_to_start" in incidents.KINDS
    assert all(len(k) <= 16 for k in incidents.KINDS)  # incident.kind is String(16)


def test_a_job_that_floods_its_output_leaves_only_its_last_lines(pg_url, run_name):
    """5000 lines and then a 200 kB line without a newline: the tail is the end of it, 4 KiB at most."""
    job = (
        "import sys\n"
        "for i in range(5000): print('noise', i)\n"
        "sys.stdout.write('z' * 200_000); sys.stdout.flush(); sys.exit(3)\n"
    )
    sup = Supervisor(Catalog(pg_url), run_name, JobSpec.from_dict({"command": ["python", "-c", job]}))
    sup.start()
    deadline = time.monotonic() + 60
    while not any(o.kind is Seen.EXITED for o in sup.poll(1.0)):
        assert time.monotonic() < deadline, "the job did not exit within 60 s"
    assert sup.finish() == 3
    tail = sup.tail()
    assert len(tail) <= TAIL_LINES and sum(len(line.encode()) + 1 for line in tail) <= TAIL_BYTES
    assert tail[-1].endswith("z" * 1000) and not any("noise" in line for line in tail[-1:])


@pytest.mark.skipif(servers.missing("postgres") is not None, reason="no PostgreSQL server binaries")
def test_the_end_of_a_launch_is_recorded_across_a_catalog_restart(tmp_path, run_name):
    """The catalog is down when the job ends (a throwaway PostgreSQL cluster, stopped for real): the
    supervisor keeps trying (bounded) and records the exit once the database is back, so the incident
    that follows is not lost (found by the catalog-restart drill)."""
    pg = servers.PostgresCluster(tmp_path / "pg")
    pg.start()
    try:
        cat = Catalog(pg.url)
        sup = Supervisor(
            cat, run_name, JobSpec.from_dict({"command": ["python", "-c", "raise SystemExit(3)"]})
        )
        sup.start()
        pg.stop()
        ended: dict[str, int] = {}
        t = threading.Thread(target=lambda: ended.setdefault("code", sup.finish()), daemon=True)
        t.start()
        assert not ended  # it cannot record the end while the database is down
        pg.start()
        t.join(timeout=60)
        assert ended == {"code": 3}
        assert [launch.exit_code for launch in jobs.launches(cat, run_name)] == [3]
    finally:
        pg.discard()


def _rewind(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rewind.flows.cli", *args],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _watch(sup: Supervisor, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while not any(o.kind is Seen.EXITED for o in sup.poll(1.0)):
        assert time.monotonic() < deadline, f"the job did not exit within {timeout_s} s"
    return sup.finish()


def test_the_jobs_whole_output_is_kept_bounded_and_masked_and_rewind_logs_shows_it(
    pg_url, run_name, tmp_path, monkeypatch
):
    """Not only the last 20 lines: every line the job printed, in a 0600 file per node under REWIND_HOME,
    rotated once past its bound (both parts kept), URL credentials masked; `rewind logs` and
    `rewind status` find it."""
    env = {"REWIND_HOME": str(tmp_path), "REWIND_CATALOG_URL": pg_url, "REWIND_JOB_LOG_MAX_MB": "0.04"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    job = (
        "import sys\n"
        "print('reading s3://key:topsecret@host/bucket')\n"
        "for i in range(4000): print('noise', i)\n"
        "sys.exit(3)\n"
    )
    sup = Supervisor(Catalog(pg_url), run_name, JobSpec.from_dict({"command": ["python", "-c", job]}))
    sup.start()
    assert _watch(sup) == 3
    kept = sup.log_dir / "node-0.log"
    assert kept.stat().st_mode & 0o777 == 0o600 and (kept.parent / "node-0.log.1").is_file()
    assert kept.stat().st_size <= 0.04 * (1 << 20)
    shown = _rewind("logs", run_name, env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[1:] == [f"noise {i}" for i in range(4000)]  # every line, in order, across the rotation
    assert "topsecret" not in shown.stdout and "reading s3://" in lines[0]
    status = _rewind("status", run_name, "--json", env=env)
    assert json.loads(status.stdout)["runs"][0]["job"]["log_dir"] == str(sup.log_dir), status.stdout
    # A reader that stops early (`| head -1`) is not an error: no message, exit 0.
    rewind = f"{shlex.quote(sys.executable)} -m rewind.flows.cli logs {shlex.quote(run_name)}"
    piped = subprocess.run(["bash", "-o", "pipefail", "-c", f"{rewind} | head -1"], env={**os.environ, **env},
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert piped.stdout.splitlines() == lines[:1]


def test_rewind_logs_follow_shows_lines_as_they_come_until_the_launch_ends(
    pg_url, run_name, tmp_path, monkeypatch
):
    env = {"REWIND_HOME": str(tmp_path), "REWIND_CATALOG_URL": pg_url}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    gate = tmp_path / "go"
    job = (
        "import os, sys, time\n"
        "print('first', flush=True)\n"
        f"while not os.path.exists({str(gate)!r}): time.sleep(0.05)\n"  # until the follower is attached
        "print('second', flush=True)\n"
    )
    sup = Supervisor(Catalog(pg_url), run_name, JobSpec.from_dict({"command": ["python", "-c", job]}))
    sup.start()
    kept = sup.log_dir / "node-0.log"
    deadline = time.monotonic() + 60
    while not (kept.is_file() and b"first" in kept.read_bytes()):
        assert time.monotonic() < deadline, "the job's first line was never kept"
        sup.poll(0.2)
    follower = subprocess.Popen(
        [sys.executable, "-m", "rewind.flows.cli", "logs", run_name, "--follow"],
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline() == "first\n"  # what was kept before it attached
        gate.touch()
        assert _watch(sup) == 0
        out, err = follower.communicate(timeout=60)  # it ends by itself once the launch has ended
    finally:
        follower.kill()
    assert follower.returncode == 0 and out == "second\n", (out, err)
