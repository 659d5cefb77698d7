"""The `rewind` executable's error contract, case by case: one line on stderr, and the exit code that says
what kind of trouble it is (2: bad input or state, 3: something unreachable right now), no secret echoed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra.catalog.db import Catalog
from infra.checkpoint.engine import Checkpointer
from infra.errors import ConfigError
from infra.net import free_port

REWIND = str(Path(sys.executable).parent / "rewind")

# (arguments, environment, exit code, what the one line says, what it must never say)
CASES = {
    "huge_step": (["ckpt", "show", "{run}", "99999999999999999999999"], {}, 2, "a step is between", None),
    "unknown_model": (["serving", "rollback", "nope"], {}, 2, "unknown model 'nope'", None),
    "unknown_run_replicated": (
        ["replicate", "no-such-run", "--to", "{tmp}/target"],
        {},
        2,
        "no run named",
        None,
    ),
    "nan_budget": (["gc", "{run}", "--budget-gb", "nan"], {}, 2, "finite number", None),
    "bad_choice": (["ckpt", "verify", "{run}", "--tier", "moon"], {}, 2, "invalid choice", None),
    "catalog_down": (
        ["ckpt", "list", "{run}"],
        {"REWIND_CATALOG_URL": "postgresql+psycopg://rewind:s3cr%40t@127.0.0.1:{port}/db"},
        3,
        "unreachable",
        "s3cr",
    ),
    "at_in_password": (
        ["ckpt", "list", "{run}"],
        {"REWIND_CATALOG_URL": "postgresql://rewind:pass@word@127.0.0.1/db"},
        2,
        "percent-encode",
        "word@",
    ),
    "s3_down_with_credentials_in_the_endpoint": (
        ["replicate", "{run}", "--to", "s3://bucket/x"],
        {
            "AWS_ENDPOINT_URL": "http://key:topsecret@127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "sk",
        },
        3,
        "unreachable",
        "topsecret",
    ),
}


@pytest.fixture(scope="module")
def a_run(pg_url, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A run with one committed checkpoint, in the session's Postgres catalog."""
    root = tmp_path_factory.mktemp("cli")
    ck = Checkpointer(
        "cli-run", states={"model": torch.nn.Linear(2, 2)}, root=root / "ckpt", catalog=Catalog(pg_url)
    )
    ck.save(1)
    return {
        "REWIND_CATALOG_URL": pg_url,
        "REWIND_CHECKPOINT_ROOT": str(root / "ckpt"),
        "REWIND_HOME": str(root),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_every_error_is_one_line_with_the_right_exit_code(case, a_run, tmp_path):
    args, env, code, says, never = CASES[case]
    fill = {"run": "cli-run", "tmp": str(tmp_path), "port": str(free_port())}
    argv = [a.format(**fill) for a in args]
    environ = {**os.environ, **a_run, **{k: v.format(**fill) for k, v in env.items()}}
    done = subprocess.run([REWIND, *argv], env=environ, capture_output=True, text=True, timeout=120)
    err = done.stderr.strip()
    assert done.returncode == code, (done.returncode, err)
    assert len(err.splitlines()) == 1 and err.startswith("rewind: error:"), err
    assert says in err, err
    if never is not None:
        assert never not in err, err
    if case == "unknown_run_replicated":
        assert not (tmp_path / "target").exists()  # nothing was created for a run that does not exist


@pytest.mark.parametrize("name", ["名" * 100, "a\\b", "a/b", ".hidden", "tab\there", ""])
def test_run_names_a_tier_cannot_hold_are_refused_where_runs_are_created(name, pg_url, tmp_path):
    with pytest.raises(ConfigError, match="run name"):
        Checkpointer(name, states={"model": torch.nn.Linear(2, 2)}, root=tmp_path, catalog=Catalog(pg_url))


def test_serving_stop_never_kills_an_unrelated_process_a_stale_file_names(tmp_path):
    """After a reboot the pids in stack.json and a proxy's state may belong to anything."""
    import json

    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)  # the pid files' new owner
    try:
        home = tmp_path / "serving"
        (home / "proxy" / "m").mkdir(parents=True)
        (home / "stack.json").write_text(
            json.dumps(
                {"inference": "http://127.0.0.1:1", "management": "http://127.0.0.1:2", "pid": bystander.pid}
            )
        )
        (home / "proxy" / "m" / "proxy.json").write_text(
            json.dumps({"port": 1, "router_port": 2, "pid": bystander.pid})
        )
        env = {**os.environ, "REWIND_SERVING_HOME": str(home), "REWIND_HOME": str(tmp_path)}
        done = subprocess.run(
            [REWIND, "serving", "stop"], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert bystander.poll() is None  # still running: neither TorchServe nor HAProxy, so left alone
    finally:
        bystander.kill()
        bystander.wait()


def test_a_command_haproxy_refuses_is_not_retried_as_an_outage(tmp_path):
    """HAProxy answered "no": asking again gets the same answer, so it must not look transient."""
    from infra.errors import Refused
    from infra.serving.haproxy import Keys, Proxy
    from tasks.common import is_transient

    proxy = Proxy(tmp_path / "proxy")
    proxy.start(["127.0.0.1:9"], Keys(frozenset(), ("",)))
    try:
        proxy.add("v1")
        proxy.set_weights({"v1": 100})  # accepted: no error
        with pytest.raises(Refused, match="No such server") as nope:
            proxy.set_weights({"v2": 10})
        with pytest.raises(Refused, match="weight") as too_heavy:  # "Absolute weight can only be ..."
            proxy.set_weights({"v1": 999})
        assert not is_transient(nope.value) and not is_transient(too_heavy.value)
        assert proxy.stats()["v1"].weight == 100
    finally:
        proxy.stop()
