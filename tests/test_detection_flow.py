"""A rank that stops stepping is detected by its heartbeat silence, recorded, and the job stopped."""

from __future__ import annotations

import sys

import pytest

from infra.catalog import incidents
from infra.catalog.db import Catalog
from tests.trainproc import REPO

pytestmark = pytest.mark.xdist_group("prefect")


def test_hung_rank_is_detected_within_its_heartbeat_timeout(
    prefect_api, rewind_env, run_name, tmp_path, monkeypatch
):
    from flows.training import protect_training

    monkeypatch.setenv("REWIND_HANG_AT_STEP", "8")
    monkeypatch.setenv("REWIND_HANG_RANK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "examples.tiny_lm_ddp",
        "--run",
        run_name,
        "--steps",
        "30",
        "--checkpoint-every",
        "5",
        "--out",
        str(tmp_path / "out"),
        "--nproc",
        "2",
    ]
    timeout, poll = 5.0, 1.0
    result = protect_training(run_name, command, str(REPO), heartbeat_timeout_s=timeout)
    assert result["status"] == "hang", result
    (inc,) = incidents.incidents_of(Catalog(), run_name)
    assert inc.kind == "hang" and inc.details["hang"]["step"] == 7
    # Silence can only be noticed once it passes the timeout, and is checked every poll interval.
    assert timeout <= inc.detection_s <= timeout + 3 * poll, inc.detection_s
    print(f"\nHANG detected after {inc.detection_s:.2f}s of silence (timeout {timeout}s): {inc.reason}")
