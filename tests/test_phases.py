"""The CLI and the flows call the same phase functions: the same command and flow announce the same
events and apply the same retention (real Prefect server, real Postgres catalog)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from rewind import Checkpointer
from rewind.flows.cli import main as rewind
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from tests.integrity_support import flip, statuses
from tests.prefect_support import wait_until

ANNOUNCED = ["rewind.checkpoint.verified", "rewind.checkpoint.corrupt", "rewind.copy.corrupt"]


def _checkpoints(run: str, steps: range) -> None:
    """A few small committed checkpoints of ``run``, written by a real Checkpointer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ck = Checkpointer(run=run, states={"model": model})
    try:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(step)
    finally:
        ck.close()


def _damage(run: str, step: int) -> None:
    (ck,) = lineage.checkpoints(Catalog(), run, step)
    flip(next(Path(ck.path).glob("*.safetensors")))


def _announced(client, run: str) -> Counter:  # type: ignore[no-untyped-def]
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    page = client.read_events(
        EventFilter(
            event=EventNameFilter(name=ANNOUNCED), resource=EventResourceFilter(id=[f"rewind.run.{run}"])
        ),
        limit=50,
    )
    return Counter(  # (event, the step of the checkpoint it names, its payload's fields)
        (e.event, int(e.related[0]["prefect.resource.name"].rsplit("@", 1)[1]), tuple(sorted(e.payload)))
        for e in page.events
    )


def test_ckpt_verify_and_the_verify_flow_announce_the_same_events(
    prefect_api: str, rewind_env: dict[str, str], run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.orchestration import get_client

    from rewind.flows.maintenance import verify_checkpoints

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # where the CLI's events go, as a user's shell says
    by_cli, by_flow = f"{run_name}-cli", f"{run_name}-flow"
    for run in (by_cli, by_flow):
        _checkpoints(run, range(1, 4))
        _damage(run, 2)

    assert rewind(["ckpt", "verify", by_cli, "--deep"]) == 1
    state = verify_checkpoints(run=by_flow, deep=True, return_state=True)
    assert state.is_failed() and f"{by_flow}@2" in str(state.message)
    assert statuses(by_cli) == statuses(by_flow) == {1: "verified", 2: "corrupt", 3: "verified"}

    expected = 4  # verified at steps 1 and 3, the corrupt checkpoint at 2 and its damaged local copy
    with get_client(sync_client=True) as client:
        cli = wait_until(
            lambda: (c := _announced(client, by_cli)).total() >= expected and c, 30, "the CLI's events"
        )
        flow = wait_until(
            lambda: (c := _announced(client, by_flow)).total() >= expected and c, 30, "the flow's"
        )
    assert cli == flow, (cli, flow)
    assert {(name, step) for name, step, *_ in cli} == {
        ("rewind.checkpoint.verified", 1),
        ("rewind.checkpoint.verified", 3),
        ("rewind.checkpoint.corrupt", 2),
        ("rewind.copy.corrupt", 2),
    }


def test_rewind_replicate_and_the_replicate_flow_apply_the_same_retention(
    prefect_api: str,
    rewind_env: dict[str, str],
    run_name: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from rewind.flows.maintenance import replicate_offsite

    monkeypatch.setenv("REWIND_KEEP_LAST", "2")  # the operator's policy, for the flow and the CLI alike
    by_cli, by_flow = f"{run_name}-cli", f"{run_name}-flow"
    for run in (by_cli, by_flow):
        _checkpoints(run, range(1, 6))
        assert rewind(["ckpt", "verify", run, "--deep"]) == 0

    assert rewind(["replicate", by_cli, "--to", str(tmp_path / "shared")]) == 0
    result = replicate_offsite(target=str(tmp_path / "shared"), run=by_flow)
    assert result["replicated"] == 5 and sorted(result["removed"][by_flow]) == [1, 2, 3], result
    assert statuses(by_cli) == statuses(by_flow)
    assert statuses(by_cli) == {1: "deleted", 2: "deleted", 3: "deleted", 4: "verified", 5: "verified"}


def test_a_training_loop_that_is_a_flow_snapshots_through_the_task_and_its_commit_is_announced(
    prefect_api: str, rewind_env: dict[str, str], run_name: str
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from rewind.tasks.snapshot import snapshot

    @flow
    def loop() -> list[int]:
        model = torch.nn.Linear(16, 16)
        ck = Checkpointer(run=run_name, states={"model": model})
        try:
            return [snapshot(ck, step).checkpoint_id for step in (1, 2)]
        finally:
            ck.close()

    ids = loop()
    assert ids == [c.id for c in lineage.checkpoints(Catalog(), run_name)]
    mine = EventResourceFilter(id=[f"rewind.run.{run_name}"])
    names = EventNameFilter(name=["rewind.checkpoint.committed"])

    def committed() -> list[int]:
        page = client.read_events(EventFilter(event=names, resource=mine), limit=10)
        return sorted(e.payload["checkpoint_id"] for e in page.events)

    with get_client(sync_client=True) as client:
        assert wait_until(lambda: len(got := committed()) == 2 and got, 30, "two committed events") == ids


def test_an_incident_of_a_launch_the_run_has_moved_past_is_not_recovered(rewind_env, run_name):
    """A recovery that waited (Late) while the operator started the job again by hand must not roll back what
    the newer launch saved nor start a second job; the newest launch's incident is recovered as ever."""
    import time

    from rewind.infra.catalog import incidents, jobs
    from rewind.infra.errors import Refused
    from rewind.infra.launch.supervisor import NOT_STARTED
    from rewind.infra.phases import recovery

    cat = Catalog()
    spec = {"command": ["python", "train.py"]}

    def crashed(launch: int) -> int:
        details = {"died_at": time.time(), "launch_id": launch}
        return incidents.open_incident(cat, run_name, "crash", "killed", details=details)

    old = crashed(jobs.begin_launch(cat, run_name, spec, {}))
    typo = jobs.begin_launch(cat, run_name, spec, {})  # a launch whose command never started: not a move
    jobs.end_launch(cat, typo, NOT_STARTED)
    args = {"max_incidents": 100, "window_s": 3600.0}
    assert recovery.begin(cat, incident_id=old, claimant="flow-0", **args).held_by is None
    old = crashed(jobs.begin_launch(cat, run_name, spec, {}))
    new = crashed(jobs.begin_launch(cat, run_name, spec, {}))  # started again by hand, and crashed too
    with pytest.raises(Refused, match="was launched again since"):
        recovery.begin(cat, incident_id=old, claimant="flow-a", **args)
    assert recovery.begin(cat, incident_id=new, claimant="flow-b", **args).held_by is None
