"""Rewind's Prefect flows against a real Prefect server and a real `rewind serve` process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterType,
    DeploymentFilter,
    FlowRunFilter,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.deployments import run_deployment
from prefect.events.filters import EventFilter, EventNameFilter

from rewind.examples.tiny_lm import command as tiny_lm_cmd
from rewind.infra.catalog import incidents, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.launch.process import find_pids
from tests.prefect_support import deployment_ids, find_pid, rewind_serve, wait_until
from tests.trainproc import REPO, TrainProc, assert_same_weights

DEPLOYMENTS = [
    "protect-training",
    "recover-training",
    "verify-checkpoints",
    "restore-checkpoint",
    "replicate-offsite",
]


@pytest.fixture(scope="module")
def flow_env(pg_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("flows")
    env = {
        "REWIND_HOME": str(home),
        "REWIND_CATALOG_URL": pg_url,
        "REWIND_CHECKPOINT_ROOT": str(home / "ckpt"),
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("REWIND_FAULT", raising=False)
        yield env


@pytest.fixture(scope="module")
def served(prefect_api, flow_env, tmp_path_factory):
    # The worker's PATH finds a `python` that cannot train (as on a machine whose system python lacks
    # torch): a command starting with "python", as the README's, must run on the worker's interpreter.
    shims = tmp_path_factory.mktemp("path")
    (shims / "python").write_text("#!/bin/sh\necho 'this python has no torch' >&2\nexit 1\n")
    (shims / "python").chmod(0o755)
    env = {**flow_env, "PATH": f"{shims}:{os.environ['PATH']}"}
    # The test harness authenticates nobody: only a test may serve from it, saying so.
    with (
        rewind_serve(prefect_api, env, "--allow-unauthenticated-api") as proc,
        get_client(sync_client=True) as client,
    ):
        wait_until(
            lambda: proc.poll() is not None or deployment_ids(client, DEPLOYMENTS),
            90,
            "rewind serve's deployments",
        )
        assert proc.poll() is None, (Path(flow_env["REWIND_HOME"]) / "serve.log").read_text()[-3000:]
        wait_until(
            lambda: client.read_automations_by_name("recover-on-failure"), 30, "the recovery automation"
        )
        yield client


def _flow_runs(client, deployment: str):
    dep = client.read_deployment_by_name(f"{deployment}/{deployment}")
    return client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [dep.id]}))


# Longer than pytest's default: the bounded waits below (plus the module's setup, up to 120 s of
# waiting for `rewind serve`, and the reference run) add up to less, so a stall is reported by the
# wait that stalled, with its own message, not by pytest's timeout.
LONG = pytest.mark.timeout(720)


@LONG
def test_crash_is_recovered_by_the_event_driven_deployment(reference, served, flow_env, run_name, tmp_path):
    client = served
    cat = Catalog()
    out = tmp_path / "out"
    run_deployment(
        "protect-training/protect-training",
        parameters={
            "run": run_name,
            "command": ["python", *tiny_lm_cmd(run_name, out)[1:]],
            "cwd": str(REPO),
        },
        timeout=0,
    )
    run_id = wait_until(lambda: _run_id(cat, run_name), 60, "the run to appear")
    wait_until(lambda: len(lineage.restorable(cat, run_id)) >= 2, 120, "two committed checkpoints")
    pid = find_pid("rewind.examples.tiny_lm", f"--run {run_name} ")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # from here on the test does nothing but wait

    def recovered():
        runs = _flow_runs(client, "recover-training")
        done = [r for r in runs if r.state and r.state.is_final()]
        return done[0] if done else None

    run = wait_until(recovered, 300, "the triggered recover-training run to finish", interval=1)
    assert run.state.is_completed(), run.state.message
    assert_same_weights(out / "final.safetensors", reference[1])
    (inc,) = incidents.incidents_of(cat, run_name)
    assert inc.kind == "crash" and inc.resolved_at is not None
    # The protected run whose job was killed reads as failed in the UI, its incident named; the trigger
    # that recovered it keys on Rewind's event, not on that state.
    (protected,) = [r for r in _flow_runs(client, "protect-training") if r.parameters.get("run") == run_name]
    assert protected.state.is_failed(), protected.state
    assert f"crash, incident {inc.id}:" in protected.state.message, protected.state.message
    # The timeline must add up: noticed within a poll, restored and relaunched after the flow started,
    # the first step after all of it; no more steps replayed than lie between two checkpoints.
    assert 0 <= inc.detection_s < 5, inc.detection_s
    assert 0 < inc.details["flow_start_s"] < inc.rto_s, (inc.details["flow_start_s"], inc.rto_s)
    assert 0 < inc.load_s < inc.rto_s and 0 < inc.rebuild_s < inc.rto_s, (
        inc.load_s,
        inc.rebuild_s,
        inc.rto_s,
    )
    assert 0 <= inc.replayed_steps <= 10, inc.replayed_steps
    came_back = inc.details["loss_change"]  # the loss at the restore point, then at the first step after it
    assert all(isinstance(came_back[k], float) for k in ("restore_point", "first_step")), came_back
    shown = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]), type=ArtifactFilterType(any_=["progress"])
        )
    )  # the relaunched job's progress, as the UI shows it
    assert [(a.data, a.description.split(", loss")[0]) for a in shown] == [
        (100.0, f"{run_name}: step 60 of 60")
    ], [(a.data, a.description) for a in shown]
    assert shown[0].description.endswith("newest verified checkpoint: step 60"), shown[0].description

    def logged():  # shipped in batches: the decision lines may land after the run is final
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        return logs if any(log.message.startswith(f"restore point of {run_name}") for log in logs) else None

    logs = wait_until(logged, 30, "recover-training's restore decision in its log")
    task_states = [log.message for log in logs if log.task_run_id and "Finished in state" in log.message]
    assert task_states == [], task_states  # what Rewind decided, not that each task finished
    print(
        f"\nRECOVERY kill->flow start {inc.details['flow_start_s']:.2f}s, kill->first step {inc.rto_s:.2f}s, "
        f"detection {inc.detection_s:.3f}s, restore {inc.load_s:.2f}s, relaunch {inc.rebuild_s:.2f}s, "
        f"replayed {inc.replayed_steps} steps"
    )


@LONG
def test_lost_rank_is_relaunched_on_fewer_ranks_automatically(served, flow_env, run_name, tmp_path):
    cat = Catalog()
    command = tiny_lm_cmd(run_name, tmp_path / "out", steps=30, every=5, module="rewind.examples.tiny_lm_ddp")
    params = {"run": run_name, "command": command, "cwd": str(REPO), "nproc_per_node": 4,
              "env": {"OMP_NUM_THREADS": "1"}}  # fmt: skip
    run_deployment("protect-training/protect-training", parameters=params, timeout=0)
    run_id = wait_until(lambda: _run_id(cat, run_name), 60, "the run to appear")
    wait_until(
        lambda: len(lineage.restorable(cat, run_id)) >= 2, 180, "two committed checkpoints", interval=0.5
    )
    workers = [
        p
        for p in find_pids("rewind.examples.tiny_lm_ddp", f"--run {run_name} ")
        if "torch.distributed.run" not in _cmdline(p)
    ]
    assert len(workers) == 4, workers
    os.kill(workers[1], signal.SIGKILL)

    def recovered():
        incs = incidents.incidents_of(cat, run_name)
        return incs[0] if incs and incs[0].resolved_at is not None else None

    inc = wait_until(recovered, 300, "the automatic recovery on fewer ranks", interval=1)
    assert inc.layout_before["dp"] == 4 and inc.layout_after["dp"] == 3, (inc.layout_before, inc.layout_after)
    assert "relaunch on 3 ranks" in inc.decision
    assert (tmp_path / "out" / "final.safetensors").exists()
    assert inc.details["resumed_at_step"] in (5, 10, 15, 20, 25)
    print(
        f"\nELASTIC 4->3 ranks: detection {inc.detection_s:.3f}s, rebuild (relaunch to first step) {inc.rebuild_s:.2f}s, "
        f"load {inc.load_s:.2f}s, replayed {inc.replayed_steps} steps, RTO {inc.rto_s:.2f}s, "
        f"kill->flow start {inc.details['flow_start_s']:.2f}s; {inc.decision}"
    )


def test_a_job_that_fails_to_start_is_an_incident_with_its_last_lines_and_not_recovered(
    served, flow_env, run_name
):
    """A job that dies at import is `failed_to_start`: its last lines in the incident, the flow log and the
    event; the recovery trigger does not cover the event (judged by the server's own matcher) and
    recover-training, run by hand, refuses in one line."""
    from prefect.server.events.schemas.automations import EventTrigger
    from prefect.server.events.schemas.events import ReceivedEvent

    from rewind.flows.training import recover_training

    client = served
    job = "print('reading the config', flush=True); import rewind_no_such_module  # a broken job"
    fr = run_deployment(
        "protect-training/protect-training",
        parameters={"run": run_name, "command": ["python", "-c", job], "cwd": str(REPO)},
        timeout=120,
    )
    assert fr.state.is_failed(), (
        fr.state.message
    )  # a job that cannot start is a failed run, with its last line
    assert "failed_to_start" in fr.state.message and "rewind_no_such_module" in fr.state.message, (
        fr.state.message
    )
    cat = Catalog()
    (inc,) = incidents.incidents_of(cat, run_name)
    assert inc.kind == "failed_to_start", (inc.kind, inc.reason)
    tail = inc.details["tail"]
    assert tail[0] == "reading the config" and "No module named 'rewind_no_such_module'" in tail[-1], tail
    assert len(tail) <= 20 and sum(len(line) + 1 for line in tail) <= 4096
    assert "failed to start" in inc.reason and "rewind_no_such_module" in inc.reason, inc.reason
    assert "\n" not in inc.reason

    def logged():  # the worker ships its logs in batches: they may land after the run is final
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))
        return any("rewind_no_such_module" in log.message and "last lines" in log.message for log in logs)

    wait_until(logged, 30, "the flow log line with the job's last lines")

    def failure_event():
        page = client.read_events(
            EventFilter(event=EventNameFilter(name=["rewind.failure.detected"])), limit=50
        )
        return [e for e in page.events if e.payload.get("run") == run_name]

    (event,) = wait_until(failure_event, 30, "the rewind.failure.detected event")
    assert event.payload["kind"] == "failed_to_start" and event.payload["tail"] == tail
    assert event.resource["rewind.incident.kind"] == "failed_to_start"
    (automation,) = client.read_automations_by_name("recover-on-failure")
    trigger = EventTrigger.model_validate(automation.trigger.model_dump(mode="json"))
    seen = ReceivedEvent.model_validate(event.model_dump(mode="json"))
    assert not trigger.covers(seen)  # the triggers service's own test: the automation is not interested
    crash = seen.model_copy(
        update={"resource": type(seen.resource)(root={**seen.resource.root, "rewind.incident.kind": "crash"})}
    )
    assert trigger.covers(crash)  # and would be for a crash

    state = recover_training(incident_id=inc.id, return_state=True)
    assert state.is_failed() and "failed to start" in state.message, state.message
    assert "\n" not in state.message.strip(), state.message
    dep = client.read_deployment_by_name("recover-training/recover-training")
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [dep.id]}))
    assert not [r for r in runs if r.parameters.get("incident_id") in (inc.id, str(inc.id))]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _run_id(cat: Catalog, name: str) -> int | None:
    try:
        return lineage.get_run(cat, name).id
    except Exception:
        return None


def _train(run: str, out: Path, *extra: str) -> TrainProc:
    p = TrainProc(run, out, extra=list(extra))
    p.finish()
    assert p.proc.returncode == 0, p.output.text
    return p


def test_restore_of_a_chosen_step_through_the_api(reference, served, flow_env, run_name, tmp_path):
    _train(run_name, tmp_path / "out")
    fr = run_deployment(
        "restore-checkpoint/restore-checkpoint", parameters={"run": run_name, "step": 20}, timeout=180
    )
    assert fr.state.is_completed(), fr.state.message
    cat = Catalog()
    head = lineage.restorable(cat, lineage.get_run(cat, run_name).id)
    assert [c.step for c in head] == [20, 10]
    again = _train(run_name, tmp_path / "out2", "--stop-after", "23")
    assert again.output.resumed_at == 20
    assert all(reference[0][s] == loss for s, loss in again.output.losses.items())


def test_transient_fault_is_retried_and_corruption_is_not(served, flow_env, run_name, tmp_path, monkeypatch):
    from rewind.flows.maintenance import restore_checkpoint_flow, verify_checkpoints

    client = served
    _train(run_name, tmp_path / "out", "--steps", "20", "--stop-after", "20")
    monkeypatch.setenv("REWIND_FAULT", "eio:verify.read#1")  # one I/O error, then healthy
    state = verify_checkpoints(run=run_name, return_state=True)
    assert state.is_completed(), state.message
    tasks = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id={"any_": [state.state_details.flow_run_id]})
    )
    retried = [t for t in tasks if t.name.startswith("verify-checkpoint") and t.run_count > 1]
    assert len(retried) == 1 and retried[0].state.is_completed()
    monkeypatch.delenv("REWIND_FAULT")

    ck = Path(flow_env["REWIND_CHECKPOINT_ROOT"]) / run_name / "step-20" / "model.safetensors"
    data = bytearray(ck.read_bytes())
    data[1000] ^= 0xFF
    ck.write_bytes(bytes(data))
    state = restore_checkpoint_flow(run=run_name, step=20, return_state=True)
    assert state.is_failed()
    assert "model.safetensors: digest_mismatch" in state.message
    tasks = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id={"any_": [state.state_details.flow_run_id]})
    )
    (restore_task,) = [t for t in tasks if t.name.startswith("restore-checkpoint")]
    assert restore_task.run_count == 1 and restore_task.state.is_failed()  # not retried

    def corrupt_event():
        page = client.read_events(
            EventFilter(event=EventNameFilter(name=["rewind.checkpoint.corrupt"])), limit=50
        )
        return [e for e in page.events if e.payload.get("run") == run_name]

    (event,) = wait_until(corrupt_event, 30, "the rewind.checkpoint.corrupt event")
    assert event.payload["step"] == 20
    assert event.resource.id == f"rewind.run.{run_name}"


def test_a_failed_roll_back_with_a_new_command_leaves_the_runs_spec_as_it_was(
    prefect_api, rewind_env, run_name
):
    """restore-checkpoint with relaunch_command records the new command only once the roll-back is done, and
    then keeps the rest of the spec (its size, its environment): a step with no checkpoint changes nothing."""
    from rewind.flows.maintenance import restore_checkpoint_flow
    from rewind.infra.catalog import jobs
    from rewind.infra.catalog.db import Catalog

    spec = {
        "command": ["python", "train.py"],
        "nnodes": 2,
        "nproc_per_node": 4,
        "env": {"NCCL_IB_HCA": "mlx5"},
    }
    jobs.set_spec(Catalog(), run_name, spec)
    before = jobs.get_spec(Catalog(), run_name)
    state = restore_checkpoint_flow(
        run=run_name, step=5, relaunch_command=["python", "other.py"], return_state=True
    )
    assert state.is_failed() and "no restorable checkpoint" in str(state.message), state.message
    assert jobs.get_spec(Catalog(), run_name) == before
