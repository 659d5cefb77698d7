"""The `rewind` executable's error contract, case by case: one line on stderr, and the exit code that says
what kind of trouble it is (2: bad input or state, 3: something unreachable right now), no secret echoed."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.errors import ConfigError
from rewind.infra.net import free_port

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
    "run_name_not_utf8": (["ckpt", "list", "r\udcff"], {}, 2, "not valid UTF-8", None),
    "catalog_port_not_a_number": (
        ["ckpt", "list", "{run}"],
        {"REWIND_CATALOG_URL": "postgresql+psycopg://rewind:hunter2@127.0.0.1:notaport/db"},
        2,
        "not a database URL",
        "hunter2",
    ),
    "budget_overflows": (
        ["gc", "{run}", "--budget-gb", "1e300", "--dry-run"],
        {},
        2,
        "from 0 to 1e+12",
        None,
    ),
    "lock_past_year_9999": (
        ["replicate", "{run}", "--to", "s3://bucket/x", "--immutable-days", "3000000"],
        {},
        2,
        "from 0 to 36500",
        None,
    ),
    "no_parts_in_flight": (
        ["replicate", "{run}", "--to", "s3://bucket/x", "--concurrency", "0"],
        {},
        2,
        "from 1",
        None,
    ),
    "s3_endpoint_not_a_url": (
        ["replicate", "{run}", "--to", "s3://bucket/x"],
        {"AWS_ENDPOINT_URL": "notaurl", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "sk"},
        2,
        "not a URL",
        None,
    ),
    "s3_endpoint_port_not_a_number": (
        ["replicate", "{run}", "--to", "s3://bucket/x"],
        {
            "AWS_ENDPOINT_URL": "http://key:hunter2@127.0.0.1:notaport",
            "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "sk",
        },
        2,
        "not a valid URL",
        "hunter2",
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


def test_a_deploy_whose_handler_or_extra_file_is_missing_is_refused_before_anything_is_exported(
    tmp_path, monkeypatch
):
    """A handler or extra file given by a path that is not there (the docs' ``examples/...`` paths, typed
    outside a checkout) is refused in one line naming it, where relative paths are taken from, and how to find
    the wheel's examples; before any server is asked or anything exported (none runs here)."""
    from rewind.infra.phases import serving
    from rewind.infra.phases.notify import LogNotifier

    monkeypatch.chdir(tmp_path)
    handler = tmp_path / "handler.py"
    handler.write_text("# a handler\n")
    for given, extra, missing in (
        ("examples/tiny_lm_handler.py", [], str(tmp_path / "examples" / "tiny_lm_handler.py")),
        (str(handler), ["model_def.py"], str(tmp_path / "model_def.py")),
    ):
        with pytest.raises(ConfigError) as got:
            serving.deploy_version(
                Catalog(f"sqlite:///{tmp_path / 'c.db'}"), model="m", run="r", step=1, notify=LogNotifier(),
                handler=given, extra_files=extra,
            )  # fmt: skip
        said = str(got.value)
        assert f"{missing} is not a file" in said and "rewind.examples" in said and "\n" not in said, said


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
    from rewind.infra.errors import Refused, is_transient
    from rewind.infra.serving.haproxy import Keys, Proxy

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


def test_rewind_serve_refuses_to_serve_deployments_from_an_unauthenticated_temporary_server(tmp_path):
    """Without PREFECT_API_URL Prefect would start a temporary server that anyone local could ask to run
    a protect-training flow with any command: `rewind serve` says how to start one that authenticates."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect"), "REWIND_HOME": str(tmp_path / "home")})
    done = subprocess.run(
        [sys.executable, "-m", "rewind.flows.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "rewind server" in line and "PREFECT_API_URL" in line, line


def test_rewind_serve_refuses_an_api_that_answers_without_a_credential(prefect_api, tmp_path):
    """A server that lets anyone in (here Prefect's own test harness) would run any local user's command as
    the serving user: `rewind serve` refuses it in one line, naming the flag for a guarded one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_API_URL": prefect_api, "REWIND_HOME": str(tmp_path / "home")})
    done = subprocess.run(
        [sys.executable, "-m", "rewind.flows.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "carry no credential" in line and "--allow-unauthenticated-api" in line, line


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://rewind@127.0.0.1:1/rewind?password=S3cretPW&sslpassword=S3cretPW",
        "postgresql://rewind:S3cretPW@127.0.0.1:1/rewind",
        "nonsense://rewind:S3cretPW@127.0.0.1:1/rewind?password=S3cretPW",
    ],
)
def test_a_catalog_password_is_never_printed_wherever_the_url_carries_it(url, tmp_path):
    env = {**os.environ, "REWIND_CATALOG_URL": url, "REWIND_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "rewind.flows.cli", "runs", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode in (2, 3), done.stderr  # bad URL / unreachable (nothing listens on port 1)
    assert "S3cretPW" not in done.stdout + done.stderr and "rewind: error:" in done.stderr, done.stderr


def test_a_job_whose_working_directory_is_missing_is_refused_at_once(tmp_path, capsys):
    from rewind.flows.cli import main

    spec = tmp_path / "job.yaml"
    spec.write_text('command: [python, -c, "pass", "{run}"]\ncwd: no-such-dir\n')
    assert main(["drill", "run", "kill-rank", "--job-spec", str(spec)]) == 2  # not a 180 s wait, then 1
    assert "not a directory" in capsys.readouterr().err


def test_protect_training_with_a_missing_working_directory_fails_in_one_line(
    prefect_api, rewind_env, run_name
):
    from rewind.flows.training import protect_training

    state = protect_training(
        run_name, ["python", "-c", "pass"], cwd="/nonexistent/rewind-job", return_state=True
    )
    assert state.is_failed()
    assert "working directory /nonexistent/rewind-job does not exist" in str(state.message), state.message


def test_protect_training_refuses_a_secret_in_its_parameters_naming_never_showing_it(
    prefect_api, rewind_env, run_name
):
    """The Prefect server keeps a flow run's parameters as given and shows them (UI, API): a secret-named
    environment variable, a secret-named flag's or override's value, or a URL with a password is refused in
    one line that names each and shows none, saying where secrets go; nothing is recorded or launched.
    Names that merely contain such a word, a tokenizer's tokens, switches and paths are no secrets."""
    from rewind.flows.training import protect_training
    from rewind.infra.catalog import jobs
    from rewind.infra.errors import NotFoundError

    command = ["python", "train.py", "--tokenizer", "gpt2", "--hf-token", "hf_abc123", "--token-file", "/t"]
    command += ["--db", "postgresql://rewind:pw-789@db/rewind", "--eos-token", "</s>", "--pad_token", "<pad>"]
    command += ["--use_auth_token", "--max-new-tokens", "64", "trainer.wandb.api_key=w-000"]
    env = {"WANDB_API_KEY": "k-456", "PGPASSWORD": "pg-1", "TOKENIZERS_PARALLELISM": "false"}
    env |= {"GOOGLE_APPLICATION_CREDENTIALS": "/run/key.json", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}
    state = protect_training(run_name, command, env=env, return_state=True)
    assert state.is_failed()
    said = str(state.message)
    for named in ("env WANDB_API_KEY", "env PGPASSWORD", "command flag --hf-token", "a URL with a password"):
        assert named in said, said
    assert "command argument trainer.wandb.api_key" in said and "worker's environment" in said, said
    assert not any(s in said for s in ("hf_abc123", "k-456", "pw-789", "pg-1", "w-000")), said
    for fine in (
        "TOKENIZERS",
        "--tokenizer",
        "--token-file",
        "eos",
        "pad_token",
        "auth",
        "new-tokens",
        "GOOGLE",
    ):
        assert fine not in said, (fine, said)
    assert "IMPLICIT" not in said and "rotate it" in said, said
    with pytest.raises(NotFoundError):
        jobs.get_spec(Catalog(), run_name)


def test_rewind_run_refuses_a_secret_before_the_server_keeps_it(monkeypatch, capsys):
    """`rewind run` checks a deployment's command and env parameters before it submits the run: a secret is
    refused in one line naming it (never showing it), and nothing reaches the server (none listens here)."""
    from rewind.flows.cli import main

    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")
    cmd = '["python", "train.py", "--api-key", "sk-123"]'
    assert main(["run", "protect-training", "-p", "run=r", "-p", f"command={cmd}"]) == 2
    said = capsys.readouterr().err
    assert "command flag --api-key" in said and "sk-123" not in said and "rotate" not in said, said


def test_protect_training_from_a_workers_temporary_directory_runs_the_job_where_it_outlives_the_run(
    prefect_api, rewind_env, run_name, tmp_path, monkeypatch
):
    """A Prefect process worker without a working_dir runs each flow run in a temporary directory
    (``TemporaryDirectory(suffix="prefect")``) that it deletes when the run ends: a job started there
    without a cwd wrote its output into it, and a recovery relaunched it in another. From such a directory
    (or one a pull step made inside it), protect-training runs the job in ~/.rewind/jobs/RUN and records
    that path for recoveries; a relative cwd there is refused in one line. From any other directory the job
    runs there, its spec left without one, as before."""
    import tempfile

    from rewind.flows.training import protect_training
    from rewind.infra.catalog import jobs

    command = ["python", "-c", "open('out.txt', 'w').write('done')"]
    with tempfile.TemporaryDirectory(suffix="prefect") as workspace:
        pulled = Path(workspace) / "repo"
        pulled.mkdir()
        monkeypatch.chdir(pulled)
        state = protect_training(run_name, command, return_state=True)
        assert state.is_completed(), state.message
        own = Path(rewind_env["REWIND_HOME"]) / "jobs" / run_name
        assert (own / "out.txt").read_text() == "done" and not (pulled / "out.txt").exists()
        assert jobs.get_spec(Catalog(), run_name)["cwd"] == str(own)
        state = protect_training(run_name, command, cwd="out", return_state=True)
        assert state.is_failed() and "is relative" in str(state.message), state.message
    here = tmp_path / "job"
    here.mkdir()
    monkeypatch.chdir(here)
    state = protect_training(f"{run_name}-b", command, return_state=True)
    assert state.is_completed(), state.message
    assert (here / "out.txt").read_text() == "done"
    assert jobs.get_spec(Catalog(), f"{run_name}-b")["cwd"] is None


def test_protect_training_of_a_command_that_cannot_start_fails_in_one_line_and_ends_its_launch(
    prefect_api, rewind_env, run_name
):
    """A mistyped program name is the flow run's one-line failure, and the launch is recorded ended (not
    shown running for ever), the heartbeat left empty ("") treated as none, the working directory as unset."""
    from rewind.flows.training import protect_training
    from rewind.infra.catalog import jobs
    from rewind.infra.catalog.db import Catalog

    state = protect_training(run_name, ["pyhton-no-such-program", "train.py"], cwd="", return_state=True)
    assert state.is_failed()
    assert "command cannot be started: 'pyhton-no-such-program'" in str(state.message), state.message
    launches = jobs.launches(Catalog(), run_name)
    assert launches and all(launch.ended_at is not None for launch in launches)


_NESTED = "a: " + "[" * 5000 + "]" * 5000 + "\ncommand: [python]\n"
_ALIASES = "command: [python]\nenv:\n" + "".join(  # a billion laughs: 9**12 strings if expanded
    f"  K{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9 if i else ["x"] * 9) + "]\n" for i in range(12)
)


@pytest.mark.parametrize(
    "text, says",
    [
        ('command: [python, -c, "pass"]\nenv: {A: 1}\n', "env must map names to strings"),
        ('command: [python, -c, "pass"]\nnnodes: "2"\n', "nnodes must be a whole number"),
        ('command: [python, -c, "pass"]\nnproc_per_node: true\n', "nproc_per_node must be a whole number"),
        (
            'command: [python, -c, "pass"]\nrdzv_endpoint: "host:notaport"\n',
            "rdzv_endpoint must be host:port",
        ),
        ("command: python train.py\n", "a list of strings"),
        (_NESTED, "nested too deeply"),
        (_ALIASES, "env must map names to strings"),
        ("command: [python]\n# " + "x" * (1 << 20), "larger than"),
        ('command: [python, -c, "pass"]\nheartbeat_timeout_s: 0\n', "heartbeat_timeout_s must be above 0"),
        ('command: [python, -c, "pass"]\nloss_spike_factor: 0.5\n', "loss_spike_factor must be above 1"),
        ('command: [python, -c, "pass"]\nlr: .nan\n', "lr must be above 0"),
        (
            'command: [python, -c, "pass"]\nnproc_per_node: 100000\n',
            "nproc_per_node (100000) must be at most",
        ),
        ('command: [python, -c, "pass"]\nnnodes: 1000000\n', "nnodes (1000000) at most 65536"),
    ],
    ids=[
        "env_int",
        "nnodes_str",
        "nproc_bool",
        "endpoint_port",
        "command_str",
        "nested",
        "aliases",
        "huge",
        "heartbeat_zero",
        "spike_below_one",
        "lr_nan",
        "nproc_huge",
        "nnodes_huge",
    ],
)
def test_a_job_spec_of_the_wrong_shape_is_refused_in_one_line(text, says, tmp_path, monkeypatch, capsys):
    """The CLI's own entry point, in this process (one case goes through the installed `rewind` below)."""
    from rewind.flows.cli import main

    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    rc = main(["drill", "run", "kill-rank", "--job-spec", str(spec)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, (rc, err)
    assert len(err.splitlines()) == 1 and err.startswith("rewind: error:") and says in err, err


def test_a_job_spec_of_the_wrong_shape_is_refused_by_the_installed_command(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text('command: [python, -c, "pass"]\nnnodes: "2"\n')
    env = {**os.environ, "REWIND_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [REWIND, "drill", "run", "kill-rank", "--job-spec", str(spec)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    err = done.stderr.strip()
    assert done.returncode == 2 and err.startswith("rewind: error:"), (done.returncode, err)
    assert len(err.splitlines()) == 1 and "nnodes must be a whole number" in err, err


def test_db_upgrade_creates_a_missing_postgres_database_or_says_who_must(tmp_path):
    from tests.conftest import ADMIN_URL, _admin

    name, role = f"rewind_walk_{uuid.uuid4().hex[:8]}", f"rw_nocreate_{uuid.uuid4().hex[:8]}"
    base = ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    env = {**os.environ, "REWIND_HOME": str(tmp_path)}
    _admin(f'CREATE ROLE "{role}" LOGIN')  # may log in, may not create databases
    try:
        limited = base.replace("postgres@", f"{role}@") + f"/{name}"
        said = subprocess.run([REWIND, "ckpt", "list", "x"], env={**env, "REWIND_CATALOG_URL": limited},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert said.returncode == 2 and "does not exist on that server" in said.stderr, (
            said.stderr
        )  # not "unreachable"
        said = subprocess.run([REWIND, "db", "upgrade"], env={**env, "REWIND_CATALOG_URL": limited},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert said.returncode == 2 and f"createdb -h 127.0.0.1 -O {role} {name}" in said.stderr, said.stderr
        for _ in range(2):  # the second run finds it there
            done = subprocess.run([REWIND, "db", "upgrade"], env={**env, "REWIND_CATALOG_URL": f"{base}/{name}"},
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
            assert done.returncode == 0 and "at revision" in done.stdout, done.stderr
        assert "created the database" not in done.stdout
    finally:
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        _admin(f'DROP ROLE IF EXISTS "{role}"')


def test_status_of_an_empty_catalog_names_the_catalog_it_read(tmp_path):
    env = {**os.environ, "REWIND_HOME": str(tmp_path), "REWIND_CATALOG_URL": f"sqlite:///{tmp_path / 'c.db'}"}
    done = subprocess.run([REWIND, "status"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"no runs in catalog sqlite:///{tmp_path / 'c.db'}" in done.stdout, done


def test_protect_training_of_a_run_a_live_job_writes_leaves_its_spec_alone(prefect_api, rewind_env, run_name):
    """A second protect-training of a run whose job is alive, or a restore-checkpoint that would relaunch it,
    fails in one line before anything is touched: the spec (the live job's recoveries must relaunch the live
    job), the lineage (no roll-back under the live job)."""
    import torch

    from rewind import Checkpointer
    from rewind.flows.maintenance import restore_checkpoint_flow
    from rewind.flows.training import protect_training
    from rewind.infra.catalog import jobs, lineage
    from rewind.infra.catalog.db import Catalog

    spec = {"command": ["python", "train.py"], "env": {"TOKEN_FILE": "/etc/job-token"}}
    jobs.set_spec(Catalog(), run_name, spec)
    before = jobs.get_spec(Catalog(), run_name)
    live = Checkpointer(
        run_name, states={"model": torch.nn.Linear(2, 2)}, root=rewind_env["REWIND_CHECKPOINT_ROOT"]
    )
    try:
        live.save(1)
        live.save(2)
        state = protect_training(run_name, ["python", "-c", "pass"], return_state=True)
        assert state.is_failed() and "is being written by" in str(state.message), state.message
        for how in ({"relaunch": True}, {"relaunch_command": ["python", "other.py"]}):
            state = restore_checkpoint_flow(run=run_name, step=1, return_state=True, **how)
            assert state.is_failed() and "is being written by" in str(state.message), state.message
        assert jobs.get_spec(Catalog(), run_name) == before
        assert {c.step: c.status for c in lineage.checkpoints(Catalog(), run_name)} == {
            1: "committed",
            2: "committed",
        }
    finally:
        live.close()
