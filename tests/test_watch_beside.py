"""The supervisor never looks away: while a committed checkpoint is being verified (held there through the
fault seam, so the verification lasts as long as the test wants), a hung rank and a killed rank are still
detected within their timeouts and the job is stopped; the verification then finishes and counts."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rewind.infra.catalog import incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from tests.prefect_support import wait_until
from tests.test_protect_any_job import config, protect, ranks_at

HANG_S = 5.0


@pytest.mark.parametrize("fault", ["hang", "exit"])
@pytest.mark.timeout(300)
def test_a_failure_is_acted_on_while_a_checkpoint_is_being_verified(
    fault: str, prefect_api: str, rewind_env: dict[str, str], run_name: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    release = tmp_path / "release"
    monkeypatch.setenv(
        "REWIND_FAULT", "hold:verify.read"
    )  # the supervisor's verification waits at its first read
    monkeypatch.setenv("REWIND_FAULT_RELEASE", str(release))
    t, result = protect(run_name, config(tmp_path, run_name, step_time_s=0.1), heartbeat_timeout_s=HANG_S)
    try:
        wait_until(lambda: Path(f"{release}.held").exists() or None, 180, "the step-10 verification held")
        pids = ranks_at(run_name, 12)
        hurt_at = time.time()
        os.kill(pids[1], signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        cat = Catalog()
        ended = wait_until(lambda: jobs.launches(cat, run_name)[-1].ended_at, 60, "the launch stopped")
        assert not release.exists()  # the verification is still held: the watch went on beside it
        assert ended.timestamp() - hurt_at <= (HANG_S + 3.0 if fault == "hang" else 3.0) + 10.0  # stop grace
    finally:
        release.touch()
        t.join(timeout=120)
    assert result["status"] == fault.replace("exit", "crash"), result
    inc = incidents.get_incident(cat, result["incident_id"])
    if fault == "hang":
        assert HANG_S <= inc.detection_s <= HANG_S + 3.0, inc.detection_s
    (ck,) = [c for c in lineage.checkpoints(cat, run_name) if c.step == 10]
    assert ck.status == "verified"  # the held verification finished and counted
