"""The drills that start services of their own, end to end through `rewind drill run`: `torchserve-kill` and
`bad-model-rollout` (real TorchServe behind real HAProxy, clients through the proxy the whole time) and
`storage-failover` (a real HA SeaweedFS: two filers on one PostgreSQL metadata store behind HAProxy, the
primary SIGKILLed mid-replication). Each drill is recorded in the catalog the test gives it, and leaves no
process of its own behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rewind.infra.catalog import drills
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills import job as drill_job
from rewind.infra.drills import servers, slo

SERVING_MISSING = servers.missing("torchserve") or servers.missing("haproxy")
FAILOVER_MISSING = servers.missing("seaweedfs") or servers.missing("postgres") or servers.missing("haproxy")


@pytest.fixture
def sqlite_env(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("REWIND_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("REWIND_CHECKPOINT_ROOT", str(tmp_path / "ckpt"))
    for k in ("REWIND_FAULT", "REWIND_FAULT_ONCE", "REWIND_MANIFEST_KEY", "REWIND_SERVING_HOME"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path


def _left_running(run: str) -> list[str]:
    """Command lines of processes still running from the drill's own directory."""
    where = str(drill_job.home() / "drills" / run)
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            if where in cmd:
                found.append(cmd)
    return found


@pytest.mark.skipif(SERVING_MISSING is not None, reason=f"{SERVING_MISSING}")
def test_serving_drills_fail_no_request_and_bring_full_service_back(prefect_api, sqlite_env, capsys):
    """`torchserve-kill`: one of two instances SIGKILLed under four clients: no request fails, the instance
    answers again within the serving SLO. `bad-model-rollout`: a version that answers wrongly is canaried
    under load and rolled back by the quality gate, no request failed; both recorded with their phases."""
    from rewind.flows.cli import main
    from rewind.infra.catalog import serving as sv

    report = sqlite_env / "report.html"
    rc = main(["drill", "run", "torchserve-kill", "bad-model-rollout", "--json", "--report", str(report)])
    got = json.loads(capsys.readouterr().out)
    kill, bad = (drills.get(Catalog(), g["id"]) for g in got)
    assert rc == 0, got
    assert kill.outcome == "passed", (kill.reason, kill.phases, kill.details)
    traffic, killed = kill.details["traffic"], kill.details["activities"]["kill-instance"]
    assert traffic["failed"] == 0 and traffic["requests"] >= 40, traffic
    assert killed["victim"] in (0, 1) and killed["seed"] == kill.seed, killed
    assert 0 < kill.phases["restart"]["s"] == kill.rto_s <= slo.load().for_kind("serving").rto_s
    assert bad.outcome == "passed", (bad.reason, bad.phases, bad.details)
    rolled, made = (
        bad.details["activities"]["roll-out-bad-version"],
        bad.details["activities"]["make-bad-version"],
    )
    assert rolled["state"] == "rolled_back" and "quality" in rolled["reason"], rolled
    assert made["bad_quality"] < made["good_quality"] / 2, made
    answered = bad.details["traffic"]["versions"]
    assert bad.details["traffic"]["failed"] == 0, bad.details["traffic"]
    # the bad version took real traffic, and the stable one answered after it, to the end
    assert answered[rolled["version"]]["answers"] > 0 and answered[rolled["stable"]]["last"] > answered[
        rolled["version"]
    ]["last"], answered  # fmt: skip
    phases = bad.phases
    assert bad.rto_s == pytest.approx(phases["detect"]["s"] + phases["rollback"]["s"], abs=0.01), phases
    assert sv.models(Catalog()) == []  # the stacks' records stayed in the drills' own catalogs
    assert _left_running(kill.run_name) == [] and _left_running(bad.run_name) == []
    page = report.read_text()
    assert "torchserve-kill" in page and "bad-model-rollout" in page and "requests=" in page


@pytest.mark.skipif(FAILOVER_MISSING is not None, reason=f"{FAILOVER_MISSING}")
def test_storage_failover_drill_keeps_one_verified_copy_and_recovers_from_it(prefect_api, sqlite_env, capsys):
    """`storage-failover`: the killed job's newest checkpoint is replicated while the S3 service's primary
    metadata server is SIGKILLed after the first file; the copy ends verified end to end through the standby
    and registered once, and with the local tier deleted the job recovers from it, bit-exact."""
    from rewind.flows.cli import main

    assert main(["drill", "run", "storage-failover", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    row = drills.get(Catalog(), got["id"])
    assert row.outcome == "passed", (row.reason, row.phases, row.details)
    acts = row.details["activities"]
    cut = acts["replicate-through-failover"]
    assert cut["killed_after"] and 0 < cut["failover_s"] < 10, cut
    if cut["attempts"] == 2:  # what filer A acknowledged, filer B held: only the rest was sent again
        assert 0 < cut["bytes_resent"] < cut["bytes_total"], cut
    assert acts["offsite-copies-verified"] is True and acts["offsite-copies-verified-after-recovery"] is True
    assert acts["recover"]["restored_step"] == cut["step"]
    assert all(row.phases[n]["status"] == "ok" for n in slo.PHASES), row.phases
    assert row.loss_max_deviation == 0.0  # bit-exact resume from the copy written through the failover
    assert _left_running(row.run_name) == []
