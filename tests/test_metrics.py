"""`rewind metrics serve` scraped by a real Prometheus server (the Debian package ``prometheus``), a series
read back through Prometheus's query API, and docs/grafana-dashboard.json checked against what is served.

The catalog is a real Postgres one built by the real engines: checkpoints saved and deep-verified, one
replicated to a shared tier (which then lags), progress reported by a rank, an open and a resolved incident
with its RTO, a passed and a failed drill.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rewind.infra import metrics
from rewind.infra.catalog import copies, drills, incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.net import free_port
from rewind.infra.replication import replicate
from rewind.infra.restore.scrub import scrub
from rewind.infra.tiers import open_tier

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docs" / "grafana-dashboard.json"
WAIT_S = 60  # every wait below ends by then


@pytest.fixture
def catalog_state(rewind_env, run_name, tmp_path) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    cat = Catalog()
    ck = Checkpointer(run_name, states={"model": torch.nn.Linear(4, 4)}, catalog=cat)
    ck.save(10)
    scrub(cat, lineage.checkpoints(cat, run_name, 10)[0], deep=True)
    (tmp_path / "shared").mkdir()  # a mounted shared path
    shared = open_tier(str(tmp_path / "shared"))
    for c in copies.without_copy(cat, shared.name, shared.uri, run_name):
        replicate(cat, c, shared)
    ck.save(20)  # verified locally, not replicated: the shared tier lags by 10 steps
    scrub(cat, lineage.checkpoints(cat, run_name, 20)[0], deep=True)
    ck.save(30)  # committed, not verified yet
    ck.close()
    launch = jobs.begin_launch(cat, run_name, {"command": ["train"]}, {"world_size": 1})
    made = lineage.checkpoints(cat, run_name, 20)[0].created_at.timestamp()
    jobs.report(cat, launch, 0, node="n0", pid=os.getpid(), step=27, step_at=made + 7.5, beat_at=made + 8)
    incidents.open_incident(cat, run_name, "hang", "rank 0 made no progress after step 27")
    done = incidents.open_incident(cat, run_name, "crash", "rank 0 exited 137")
    incidents.update_incident(cat, done, rto_s=41.5)
    incidents.resolve(cat, done)
    scenario = f"scn-{run_name}"
    drills.record(cat, scenario=scenario, failure_kind="crash", run_name=run_name, outcome="failed")
    drills.record(
        cat, scenario=scenario, failure_kind="crash", run_name=run_name, outcome="passed", rto_s=12.25
    )
    return {
        "run": run_name,
        "scenario": scenario,
        "shared": shared.name,
        "url": rewind_env["REWIND_CATALOG_URL"],
    }


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _value(got: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return got[(name, frozenset(labels.items()))]


def test_the_collector_reads_every_series_from_one_overview(catalog_state):
    s = catalog_state
    got = _samples(generate_latest(metrics.registry(Catalog)).decode())
    run, shared, scn = s["run"], s["shared"], s["scenario"]
    assert _value(got, "rewind_catalog_up") == 1
    verified_age = _value(got, "rewind_checkpoint_age_seconds", run=run, status="verified")
    committed_age = _value(got, "rewind_checkpoint_age_seconds", run=run, status="committed")
    assert 0 <= committed_age <= verified_age < 600
    assert _value(got, "rewind_checkpoint_step", run=run, status="verified") == 20
    assert _value(got, "rewind_checkpoint_step", run=run, status="committed") == 30
    assert _value(got, "rewind_checkpoint_save_stall_seconds", run=run) > 0
    assert _value(got, "rewind_verified_checkpoints", run=run) == 2
    assert _value(got, "rewind_rpo_steps", run=run) == 7
    assert _value(got, "rewind_rpo_seconds", run=run) == pytest.approx(7.5, abs=0.01)
    assert _value(got, "rewind_tier_bytes", run=run, tier="local") > 0
    assert _value(got, "rewind_tier_bytes", run=run, tier=shared) > 0
    assert _value(got, "rewind_tier_copies", run=run, tier=shared) == 1
    assert _value(got, "rewind_replication_lag_steps", run=run, tier="local") == 0
    assert _value(got, "rewind_replication_lag_steps", run=run, tier=shared) == 10
    assert _value(got, "rewind_replication_lag_seconds", run=run, tier=shared) > 0
    assert _value(got, "rewind_open_incidents", run=run, kind="hang") == 1
    assert ("rewind_open_incidents", frozenset({("run", run), ("kind", "crash")})) not in got  # resolved
    assert _value(got, "rewind_incidents_total", kind="crash") >= 1
    assert _value(got, "rewind_incident_rto_seconds_count", kind="crash") >= 1
    assert _value(got, "rewind_incident_rto_seconds_sum", kind="crash") >= 41.5
    assert _value(got, "rewind_incident_last_rto_seconds", kind="crash") > 0
    assert _value(got, "rewind_drills_total", scenario=scn, outcome="passed") == 1
    assert _value(got, "rewind_drills_total", scenario=scn, outcome="failed") == 1
    assert _value(got, "rewind_drill_verdict", scenario=scn, outcome="passed") == 1  # the newest one's
    assert _value(got, "rewind_drill_verdict", scenario=scn, outcome="failed") == 0
    assert _value(got, "rewind_drill_rto_seconds", scenario=scn) == 12.25
    assert abs(_value(got, "rewind_drill_last_timestamp_seconds", scenario=scn) - time.time()) < 600


def test_a_catalog_that_is_down_is_a_value_not_a_failed_scrape_and_no_secret_is_shown():
    url = f"postgresql+psycopg://rewind:pw-s3cr3t@127.0.0.1:{free_port()}/db?sslpassword=other-s3cr3t"
    text = generate_latest(metrics.registry(lambda: Catalog(url))).decode()
    assert _value(_samples(text), "rewind_catalog_up") == 0
    assert "s3cr3t" not in text and "127.0.0.1" not in text
    # through the command: it starts anyway, says so in one line without the password, serves up 0
    port = free_port()
    proc = _serve(port, {**os.environ, "REWIND_CATALOG_URL": url})
    try:
        body = _scrape(proc, port)
        assert _value(_samples(body), "rewind_catalog_up") == 0 and "s3cr3t" not in body
    finally:
        out, err = _stop(proc)
    assert "s3cr3t" not in out + err and "serving rewind_catalog_up 0 until it is" in err, err


def _serve(port: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`rewind metrics serve` of this checkout (``-m`` from the repository, not an installed copy)."""
    cmd = [sys.executable, "-m", "rewind.flows.cli", "metrics", "serve", "--port", str(port)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env or os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _scrape(proc: subprocess.Popen[str], port: int) -> str:
    """GET /metrics once it answers (bounded; the process ending first fails at once)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"rewind metrics serve exited {proc.returncode}: {proc.communicate()[1]}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            r.raise_for_status()
            return r.text
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM, then the output; a process that does not end within 20 s is killed and fails the test."""
    proc.terminate()
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=20)
        pytest.fail("did not stop within 20 s of SIGTERM")
    return out, err


@pytest.fixture
def served(catalog_state) -> Iterator[dict[str, Any]]:  # type: ignore[no-untyped-def]
    port = free_port()
    proc = _serve(port)
    try:
        body = _scrape(proc, port)
        yield {**catalog_state, "port": port, "body": body}
    finally:
        out, err = _stop(proc)
        assert proc.returncode == 143 and "stopped by SIGTERM" in err, (proc.returncode, err)
        assert f"on http://127.0.0.1:{port}/metrics" in out, out


@pytest.fixture
def prometheus_bin() -> str:
    found = shutil.which("prometheus")
    if found is None:
        why = "the prometheus binary is not installed (apt-get install prometheus)"
        if os.environ.get("REWIND_REQUIRE_PROMETHEUS"):  # CI: this test must run
            pytest.fail(why)
        pytest.skip(why)
    return found


class Prometheus:
    def __init__(self, binary: str, home: Path, target_port: int) -> None:
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        home.mkdir()
        (home / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: rewind\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n"
        )
        self.log = (home / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.home = home

    def until(self, what: str, probe: Any) -> Any:
        """Poll ``probe`` (None: not yet) until it answers; bounded by WAIT_S, Prometheus's log on failure."""
        deadline = time.monotonic() + WAIT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited {self.proc.returncode}: {self.tail()}")
            try:
                got = probe()
            except httpx.TransportError:
                got = None
            if got is not None:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {WAIT_S}s; prometheus said: {self.tail()}")
            time.sleep(0.2)

    def query(self, expr: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api}/api/v1/query", params={"query": expr}, timeout=10)
        body: dict[str, Any] = r.json()
        assert body["status"] == "success", (expr, body)
        return body

    def tail(self) -> str:
        self.log.flush()
        return (self.home / "prometheus.log").read_text()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
            pytest.fail("prometheus did not stop within 20 s of SIGTERM")
        finally:
            self.log.close()


def test_prometheus_scrapes_rewind_metrics_serve_and_answers_a_query_for_the_rpo(
    prometheus_bin, served, tmp_path
):  # prometheus_bin first: a skip builds no catalog
    prom = Prometheus(prometheus_bin, tmp_path / "prom", served["port"])
    try:
        ready = prom.until(
            "ready", lambda: True if httpx.get(f"{prom.api}/-/ready", timeout=5).status_code == 200 else None
        )
        assert ready
        version = httpx.get(f"{prom.api}/api/v1/status/buildinfo", timeout=10).json()["data"]["version"]
        rpo = f'rewind_checkpoint_age_seconds{{run="{served["run"]}",status="verified"}}'
        (series,) = prom.until("series", lambda: prom.query(rpo)["data"]["result"] or None)
        age = float(series["value"][1])
        assert 0 <= age < 600 and series["metric"]["job"] == "rewind", series
        (up,) = prom.query('up{job="rewind"}')["data"]["result"]
        assert up["value"][1] == "1"
        # every query of the dashboard is valid PromQL to this Prometheus and has data to show
        for panel, expr in _dashboard_exprs():
            got = prom.query(expr.replace("$run", ".*"))["data"]["result"]
            assert got, f"panel {panel!r}: {expr} returned nothing"
        print(f"prometheus {version}: {rpo} = {age}")
    finally:
        prom.stop()


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_the_grafana_dashboard_loads_and_asks_only_for_served_series(served):
    dash = json.loads(DASHBOARD.read_text())
    assert isinstance(dash["title"], str) and dash["title"]
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids), "panel ids are unique"
    for p in dash["panels"]:
        assert isinstance(p["type"], str) and p["title"], p
        pos = p["gridPos"]
        assert {"x", "y", "w", "h"} <= set(pos) and 0 < pos["x"] + pos["w"] <= 24, p
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p
    served_names = {name for name, _ in _samples(served["body"])}
    asked = [p["query"]["query"] for p in dash["templating"]["list"] if p["type"] == "query"]
    asked += [expr for _, expr in _dashboard_exprs()]
    names = {n for e in asked for n in re.findall(r"\b[a-z_:][a-z0-9_:]*\b", e) if n.startswith("rewind_")}
    assert names and names <= served_names, names - served_names
    # every series the endpoint serves has a panel (a new metric goes on the dashboard too)
    families = {n.removesuffix("_count").removesuffix("_sum") for n in served_names}
    shown = {n.removesuffix("_count").removesuffix("_sum") for n in names}
    assert families - shown == set(), families - shown
    assert served["url"] not in served["body"] and "postgres" not in served["body"]
