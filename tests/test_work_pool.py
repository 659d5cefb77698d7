"""The flows on a Prefect work pool, as the README documents: `prefect deploy --all` from the repository's
`prefect.yaml` against a real `rewind server`, a real `prefect worker start --pool` process, and a
protected run whose job is SIGKILLed recovered by the trigger on that worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewind.examples.tiny_lm import command as tiny_lm_cmd
from rewind.flows.deployments import DEPLOYMENTS
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.net import free_port
from tests.prefect_support import REPO, find_pid, stop_group, wait_until
from tests.trainproc import assert_same_weights
from tests.ui_support import Server, rewind_server

POOL = "rewind"


@dataclass
class Pool:
    server: Server
    env: dict[str, str]  # what the worker, and every `prefect` command here, runs with
    home: Path

    def api(self, method: str, path: str, body: Any = None) -> Any:
        r = httpx.request(method, f"{self.server.api}{path}", json=body, auth=self.server.auth, timeout=15)
        assert r.status_code < 300, (path, r.status_code, r.text[:500])
        return r.json()

    def prefect(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "prefect", "--no-prompt", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )


@pytest.fixture(scope="module")
def pool(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    home = tmp_path_factory.mktemp("work-pool")
    # Its environment still points PREFECT_API_URL at another port (an operator's shell left from another
    # server): the UI must call the API of the server it came from all the same.
    stray = {"PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    with rewind_server(home / "server", free_port(), env=stray) as server:
        assert server.credential is not None
        env = {
            **os.environ,
            "PREFECT_API_URL": server.api,
            "PREFECT_API_AUTH_STRING": server.credential,
            "PREFECT_HOME": str(home / "client-prefect"),
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "REWIND_HOME": str(home),
            "REWIND_CATALOG_URL": pg_url,
            "REWIND_CHECKPOINT_ROOT": str(home / "ckpt"),
        }
        env.pop("REWIND_FAULT", None)
        yield Pool(server, env, home)


@pytest.mark.timeout(720)
def test_prefect_deploy_all_and_a_worker_protect_and_recover(pool, reference, run_name, tmp_path):
    made = pool.prefect("work-pool", "create", POOL, "--type", "process")
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    deployed = pool.prefect("deploy", "--all")
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]

    # Every deployment of the table, on the pool, and every trigger as an automation.
    by_name = {d["name"]: d for d in pool.api("POST", "/deployments/filter", {})}
    assert set(by_name) == {d.name for d in DEPLOYMENTS}, sorted(by_name)
    assert {d["work_pool_name"] for d in by_name.values()} == {POOL}
    automations = {a["name"]: a for a in pool.api("POST", "/automations/filter", {})}
    wanted = {t.name for d in DEPLOYMENTS for t in d.triggers}
    assert wanted <= set(automations), sorted(automations)
    assert (
        automations["recover-on-failure"]["enabled"] and not automations["replicate-on-verified"]["enabled"]
    )

    # The worker starts in a directory of its own: the flows come from the installed package.
    workdir = tmp_path / "worker"
    workdir.mkdir()
    with open(pool.home / "worker.log", "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
            cwd=workdir,
            env=pool.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _protect_kill_and_recover(pool, worker, reference, run_name, tmp_path / "out")
    finally:
        stop_group(worker)
    _an_operator_follows_it_in_the_ui(pool, run_name)


def _protect_kill_and_recover(
    pool: Pool, worker: subprocess.Popen, reference, run_name: str, out: Path
) -> None:
    deps = {d["name"]: d["id"] for d in pool.api("POST", "/deployments/filter", {})}
    command = ["python", *tiny_lm_cmd(run_name, out)[1:]]  # "python": the flow runs it on its own interpreter
    pool.api(
        "POST",
        f"/deployments/{deps['protect-training']}/create_flow_run",
        {"parameters": {"run": run_name, "command": command}},
    )
    cat = Catalog(pool.env["REWIND_CATALOG_URL"])

    def checkpoints() -> bool:
        assert worker.poll() is None, (pool.home / "worker.log").read_text()[-3000:]
        runs = [r for r in lineage.list_runs(cat) if r["run"] == run_name]
        return bool(runs) and len(lineage.restorable(cat, lineage.get_run(cat, run_name).id)) >= 2

    wait_until(checkpoints, 180, "two committed checkpoints of the run the worker started")
    pid = find_pid("rewind.examples.tiny_lm", f"--run {run_name} ")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)

    def recovered() -> dict[str, Any] | None:
        body = {"deployments": {"id": {"any_": [deps["recover-training"]]}}}
        done = [r for r in pool.api("POST", "/flow_runs/filter", body) if r["state_type"] in FINAL]
        return done[0] if done else None

    run = wait_until(
        recovered, 300, "recover-training, started by the trigger, to finish on the worker", interval=1
    )
    assert run["state_type"] == "COMPLETED", (run["state"], (pool.home / "worker.log").read_text()[-3000:])
    # The crashed run's failure is its state's message, not a traceback from Prefect's engine.
    said = (pool.home / "worker.log").read_text()
    assert "Finished in state Failed('crash, incident" in said, said[-3000:]
    assert "Engine execution exited" not in said and "dict cannot be resolved" not in said, said[-3000:]
    assert_same_weights(out / "final.safetensors", reference[1])


FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

# What a person does on the login page: type the credential, press Login (the form's own submit).
TYPE_AND_LOG_IN = """(() => {
  const input = document.querySelector('input[type=password]');
  Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(input, %s);
  input.dispatchEvent(new Event('input', {bubbles: true}));
  input.form.requestSubmit();
  return true;
})()"""


def _an_operator_follows_it_in_the_ui(pool: Pool, run_name: str) -> None:
    """A real headless Chromium, as an operator, on a UI at a non-default port: a page opened before logging
    in leads to the login and, once logged in, back to it (every deployment listed); the crashed run reads Failed with its incident; the recovery run reads
    Completed and shows its timeline artifact."""
    from rewind.infra.catalog import incidents
    from rewind.infra.phases.notify import artifact_key
    from tests.ui_support import browser, chromium

    assert chromium() is not None, "no chromium on this machine (apt-get install chromium)"
    (incident,) = incidents.incidents_of(Catalog(pool.env["REWIND_CATALOG_URL"]), run_name)
    deps = {d["name"]: d["id"] for d in pool.api("POST", "/deployments/filter", {})}

    def run_of(deployment: str) -> str:
        body = {"deployments": {"id": {"any_": [deps[deployment]]}}}
        return str(pool.api("POST", "/flow_runs/filter", body)[0]["id"])

    base = pool.server.base
    settings = httpx.get(f"{base}/ui-settings", timeout=5).json()
    assert settings["api_url"] == pool.server.api and settings["auth"] == "BASIC", settings
    names = sorted(d.name for d in DEPLOYMENTS)
    # The page counts them all and lists the first 10, A to Z (a second page holds the rest).
    listed = (f"{len(names)} Deployments", *names[:10])
    with browser() as page:
        page.goto(f"{base}/deployments")
        wait_until(
            lambda: page.evaluate("location.pathname") == "/login", 60, "/deployments to lead to the login"
        )
        assert "redirect=%2Fdeployments" in page.evaluate("location.search")
        page.wait_for_text(lambda t: "Login" in t, 60, "the login form")
        assert page.evaluate(TYPE_AND_LOG_IN % json.dumps(pool.server.credential))
        page.wait_for_text(lambda t: all(w in t for w in listed), 90, "the deployments page to list them")
        assert page.evaluate("location.pathname") == "/deployments"  # back where the person was going

        page.goto(f"{base}/runs/flow-run/{run_of('protect-training')}")
        page.wait_for_text(lambda t: "Failed" in t and f"incident {incident.id}" in t, 90, "the crashed run")
        recovery = f"{base}/runs/flow-run/{run_of('recover-training')}"
        page.goto(recovery)
        page.wait_for_text(lambda t: "Completed" in t, 90, "the recovery run, completed")
        key = artifact_key("rewind", run_name, "recovery")  # its timeline, as the run's artifact links it
        (made,) = pool.api("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}})
        page.goto(f"{base}/artifacts/artifact/{made['id']}")
        page.wait_for_text(
            lambda t: (
                f"Recovery of {run_name} (incident {incident.id})" in t and "first step after restore" in t
            ),
            60,
            f"the recovery's timeline artifact {key}",
        )
