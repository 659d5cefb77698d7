"""The walk-through of the README and docs/orchestration.md, typed as printed by a new user.

`rewind server`, the `export`, `rewind db upgrade` (its Postgres database created by it) and `rewind serve`
are read from the docs' own bash blocks (tests/walkthrough.py says what a test changes); the user's
own `train.py` is then protected with the README's `rewind run protect-training ...` line. The same
server answers the checks of the credential and the schedules.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from rewind.infra.net import free_port
from tests.conftest import ADMIN_URL
from tests.prefect_support import REPO, wait_until
from tests.walkthrough import ORCHESTRATION, README, Shell, block_under, fresh_shell, inline_command

DEPLOYMENTS = {"protect-training", "recover-training", "verify-checkpoints", "restore-checkpoint"}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
REWIND = str(Path(sys.executable).parent / "rewind")
# The user's own script: the README's first example, run as `python train.py` with no arguments.
TRAIN_PY = f"""import runpy, sys
sys.argv = ["train.py", "demo", "out", "60"]
runpy.run_path({str(REPO / "examples" / "minimal_session.py")!r}, run_name="__main__")
"""


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shell]:
    commands = block_under(ORCHESTRATION, "## Walk-through on one machine")
    # The README's short form is the same walk-through without the Postgres line.
    assert [c for c in commands if "REWIND_CATALOG_URL" not in c] == block_under(README, "On one machine:")
    database = f"rewind_walk_{uuid.uuid4().hex[:8]}"
    try:
        with fresh_shell(tmp_path_factory.mktemp("walk"), free_port(), database) as shell:
            for line in commands:
                shell.type(line)
                if line.endswith("rewind server"):
                    shell.server()  # the next line's clients need it up, as a person waits for it
            _wait_for_deployments(shell)
            yield shell
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def _wait_for_deployments(shell: Shell) -> None:
    server = shell.server()

    def registered() -> bool:
        assert all(p.poll() is None for p in shell.servers), shell.logs()
        r = httpx.post(f"{server.api}/deployments/filter", json={}, timeout=5, auth=server.auth)
        return r.status_code == 200 and {d["name"] for d in r.json()} >= DEPLOYMENTS

    wait_until(registered, 120, "rewind serve's deployments on the walk-through's server")


@pytest.mark.timeout(600)
def test_the_walk_through_protects_a_users_own_script_as_typed(walk: Shell) -> None:
    job = walk.home / "job"
    job.mkdir()
    (job / "train.py").write_text(TRAIN_PY)
    started = walk.type(inline_command(README, ".venv/bin/rewind run protect-training"), cwd=job)
    assert "/runs/flow-run/" in started.stdout, started.stdout  # where to watch it in the UI
    server = walk.server()

    def finished() -> dict | None:
        r = httpx.post(f"{server.api}/flow_runs/filter", json={}, timeout=5, auth=server.auth)
        assert r.status_code == 200, r.text[:500]
        done = [fr for fr in r.json() if fr["state_type"] in FINAL and fr["parameters"].get("run") == "demo"]
        return done[0] if done else None

    run = wait_until(finished, 300, "the protected run of train.py to finish", interval=1)
    assert run["state_type"] == "COMPLETED", (run["state"], walk.logs())
    assert (job / "out" / "final.safetensors").exists()  # ran in the `cwd=$PWD` it was given
    status = walk.type(".venv/bin/rewind status demo")
    assert "newest verified   step 60" in status.stdout, status.stdout  # in the Postgres catalog exported
    assert "ended, exit 0" in status.stdout, status.stdout


def test_schedules_have_upcoming_runs_on_a_real_server(walk: Shell) -> None:
    """The server `rewind server` starts refuses API calls without its credential; `rewind serve` has it."""
    server = walk.server()
    cred_file = walk.home / ".rewind" / "prefect-auth"
    assert cred_file.stat().st_mode & 0o077 == 0  # only its owner can read the credential
    assert (cred_file.parent / "prefect" / "prefect.db").exists()  # Prefect's home under REWIND_HOME
    assert (
        httpx.post(f"{server.api}/flow_runs/filter", json={}, timeout=5).status_code == 401
    )  # no credential

    def upcoming() -> set | None:
        body = {"flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}}
        r = httpx.post(f"{server.api}/flow_runs/filter", json=body, timeout=5, auth=server.auth)
        deps = httpx.post(f"{server.api}/deployments/filter", json={}, timeout=5, auth=server.auth).json()
        by_id = {d["id"]: d["name"] for d in deps}
        scheduled = {by_id.get(fr["deployment_id"]) for fr in r.json()} if r.status_code == 200 else set()
        return scheduled if "verify-checkpoints" in scheduled else None

    scheduled = wait_until(upcoming, 90, "scheduled runs of verify-checkpoints", interval=1)
    assert "replicate-offsite" not in scheduled  # paused until a target is configured


def test_rewind_run_starts_a_deployment_with_the_servers_credential(walk: Shell, run_name: str) -> None:
    """`rewind run` is a client of `rewind server`: it finds the credential by itself (no
    PREFECT_API_AUTH_STRING set), and a parameter that parses as JSON goes in as JSON."""
    banner = (walk.home / "1-serve.log").read_text()
    # What `rewind serve` suggests is what works: `prefect deployment run` would lack the credential.
    assert "rewind run DEPLOYMENT" in banner and "prefect deployment run" not in banner, banner[:2000]
    server = walk.server()
    argv = [REWIND, "run", "protect-training", "-p", f"run={run_name}", "-p", 'command=["python", "-c", "pass"]',
            "-p", f"cwd={REPO}", "--json"]  # fmt: skip
    done = subprocess.run(argv, env=walk.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    r = httpx.get(f"{server.api}/flow_runs/{row['flow_run_id']}", timeout=5, auth=server.auth)
    assert r.status_code == 200 and r.json()["parameters"]["command"] == ["python", "-c", "pass"], r.text
    assert row["ui"].endswith(f"/runs/flow-run/{row['flow_run_id']}")
    missing = subprocess.run([REWIND, "run", "no-such-deployment"], env=walk.env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert missing.returncode == 2 and "no deployment no-such-deployment/no-such-deployment" in missing.stderr
