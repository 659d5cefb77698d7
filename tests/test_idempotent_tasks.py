"""A task retried after its transaction committed finds its own record: one incident, one failure event,
one recovery, one rollout; and a rollout loop finishing late cannot overwrite a manual rollback."""

from __future__ import annotations

import time
import uuid

from prefect import flow
from prefect.events import emit_event
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

from rewind.infra.catalog import incidents, lineage
from rewind.infra.catalog import serving as sv
from rewind.infra.catalog.db import Catalog
from rewind.infra.phases.detect import Outcome
from tests.prefect_support import wait_until


def _outcome(run: str) -> Outcome:
    return Outcome(
        run=run, how="was killed by SIGKILL", kind="crash", exit_code=-9, last_step=20, first_step_at=None,
        died_at=time.time(), launch_id=uuid.uuid4().int % 10**12, spec={"command": ["true"]},
        tail=("step 20 loss 1.0",),
    )  # fmt: skip


def _events(client, name: str, run: str) -> list:  # type: ignore[no-untyped-def]
    mine = EventResourceFilter(id=[f"rewind.run.{run}"])
    page = client.read_events(EventFilter(event=EventNameFilter(name=[name]), resource=mine), limit=50)
    return [e for e in page.events if e.payload.get("run") == run]


def test_record_failure_retried_after_commit_is_one_incident_one_event_one_recovery(
    prefect_api, rewind_env, run_name
):
    from prefect.client.orchestration import get_client

    from rewind.flows.training import recover_training, summary
    from rewind.tasks.detect import record_failure

    lineage.ensure_run(Catalog(), run_name)
    outcome = _outcome(run_name)

    @flow
    def detector_retried() -> tuple[int, int]:
        return record_failure(outcome), record_failure(outcome)  # the second: a retry after the commit

    first, again = detector_retried()
    assert first == again
    assert [i.id for i in incidents.incidents_of(Catalog(), run_name)] == [first]
    emit_event(event="rewind.test.sentinel", resource={"prefect.resource.id": f"rewind.run.{run_name}"},
               payload={"run": run_name})  # fmt: skip
    with get_client(sync_client=True) as client:
        wait_until(lambda: _events(client, "rewind.test.sentinel", run_name), 30, "the sentinel event")
        assert len(_events(client, "rewind.failure.detected", run_name)) == 1

    incidents.claim_recovery(Catalog(), first, "flow-run:the-automatic-one")
    second = summary(
        recover_training(first, return_state=True)
    )  # a duplicate delivery, or a recovery started by hand beside it
    assert second["status"] == "already-recovering" and second["by"] == "flow-run:the-automatic-one"


def test_open_rollout_retried_is_one_rollout_and_a_late_finish_keeps_a_rollback(prefect_api, rewind_env):
    from rewind.tasks.serving import finish_rollout, open_rollout

    model = f"m{uuid.uuid4().hex[:8]}"

    @flow
    def rollout_retried() -> tuple[int, int]:
        args = {"from_version": "v1", "triggered_by": "test", "params": {}}
        return open_rollout(model, "rollout", "v2", **args), open_rollout(model, "rollout", "v2", **args)

    rid, again = rollout_retried()
    assert rid == again and [r.id for r in sv.running_rollouts(Catalog(), model)] == [rid]

    @flow
    def manual_rollback() -> int:
        return open_rollout(model, "rollback", "v1", from_version="v2", triggered_by="operator", params={})

    manual_rollback()
    assert finish_rollout(rid, "promoted") == "rolled_back"  # the rollout loop, finishing late
    assert sv.get_rollout(Catalog(), rid).state == "rolled_back"
