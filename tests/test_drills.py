"""Recovery drills end to end: a Chaos Toolkit experiment (crash inside a checkpoint save) run by
chaostoolkit-lib against the tiny_lm example under the real flows (Prefect test harness), on a SQLite
catalog; the drill row, its phases, RPO and loss curve, and its verdict against an SLO file, including one
whose restore budget is broken on purpose, so the failed drill names that phase."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.catalog import drills
from infra.catalog.db import Catalog
from infra.drills import experiments, slo

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sqlite_env(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("REWIND_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("REWIND_CHECKPOINT_ROOT", str(tmp_path / "ckpt"))
    for k in ("REWIND_FAULT", "REWIND_FAULT_ONCE", "REWIND_MANIFEST_KEY"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path


def test_scenarios_are_chaos_toolkit_experiments():
    from chaoslib.experiment import ensure_experiment_is_valid

    found = experiments.load_all()
    runnable = [n for n, e in found.items() if not experiments.rewind_ext(e).get("skip")]
    assert len(runnable) >= 8, runnable
    for name, exp in found.items():
        exp = {**exp, "configuration": {"run": "x", "state_dir": "/tmp"}}
        ensure_experiment_is_valid(exp)  # chaostoolkit-lib's own validation (functions and arguments)
        assert experiments.rewind_ext(exp).get("failure_kind"), name


def test_crash_at_save_drill_is_recorded_and_judged(prefect_api, sqlite_env):
    from flows.drills import run_one

    tight = sqlite_env / "slo.yaml"  # the crash budget passes, but restore may take 1 ms: broken on purpose
    tight.write_text("kinds:\n  crash: {rto_s: 120, max_replay_steps: 20, phases: {restore: 0.001}}\n")
    got = run_one("crash-at-save", slo_file=str(tight), job={"steps": 30, "step_time_s": 0.05})
    row = drills.get(Catalog(), got["id"])
    assert row.outcome == "failed" and row.failed_phase == "restore", (row.reason, row.phases, row.details)
    assert "restore took" in (row.reason or "") and row.phases["restore"]["status"] == "over_budget"
    assert row.details["journal_status"] == "completed" and row.details["error"] is None, row.details
    assert row.incident_id is not None and row.seed == 0 and row.slo["phases"] == {"restore": 0.001}
    for name in ("detect", "decide", "restore", "rebuild", "relaunch", "first_step", "replay"):
        assert row.phases[name]["s"] is not None and row.phases[name]["s"] >= 0, (name, row.phases)
    assert row.rpo_steps == 10 and row.rpo_s is not None and row.rpo_s > 0  # killed saving 20, resumed at 10
    assert 0 < row.rto_s < 120
    assert row.loss_curve["steps"][0] == 11 and row.loss_curve["steps"][-1] == 30
    assert row.loss_max_deviation == 0.0  # bit-exact resume: the curve is the reference run's
    # The same measurements against the repository's SLO file pass: only the broken budget failed it.
    verdict = slo.judge(
        slo.load(REPO / "rewind-slo.yaml").for_kind("crash"), dict(row.phases), row.rto_s, row.rpo_steps
    )
    assert verdict.passed, verdict


def test_drill_cli_lists_reports_and_refuses_bad_input(sqlite_env, capsys):
    from flows.cli import main

    assert main(["drill", "list"]) == 0
    listed = capsys.readouterr().out
    assert "crash-at-save" in listed and "skipped" in listed
    assert main(["drill", "run", "no-such-scenario"]) == 2
    assert "no drill scenario" in capsys.readouterr().err
    assert main(["drill", "run"]) == 2
    assert main(["drill", "run", "crash-at-save", "--slo", str(sqlite_env / "absent.yaml")]) == 2
    bad = sqlite_env / "bad.yaml"
    bad.write_text("kinds:\n  crash: {rto_s: -1}\n")
    assert main(["drill", "run", "crash-at-save", "--slo", str(bad)]) == 2
    assert "budgets must be positive" in capsys.readouterr().err
    assert main(["drill", "goodput", "--steps", "5"]) == 2
    drills.record(Catalog(), scenario="s3-outage", failure_kind="offsite", outcome="skipped", reason="why")
    out = sqlite_env / "report.html"
    assert main(["drill", "report", "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "s3-outage" in page


def test_run_drills_flow_records_a_skipped_scenario_with_its_reason(prefect_api, sqlite_env):
    from flows.drills import run_drills

    (got,) = run_drills(["s3-outage"])
    assert got["outcome"] == "skipped" and "not built yet" in got["reason"]
    row = drills.get(Catalog(), got["id"])
    assert row.outcome == "skipped" and row.reason == got["reason"] and row.slo["rto_s"] == 600
