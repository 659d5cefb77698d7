"""Serving's phases as Prefect tasks (``phases.serving``): names, timeouts, retries for transient faults.

A retry of ``open-rollout`` finds the record its first try made (the flow run is its origin).
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.runtime import flow_run

from rewind.infra.catalog.models import RolloutKind, VersionState
from rewind.infra.phases import serving as phase
from rewind.infra.phases.serving import Loaded, RollbackTarget, ServingState, Switched
from rewind.infra.serving.gates import Result
from rewind.tasks.common import RETRY, catalog, notifier


@task(name="serving-state", **RETRY)
def serving_state(model: str) -> ServingState:
    """What serves ``model`` now, per the catalog; NotFoundError for a model never deployed."""
    return phase.serving_state(catalog(), model=model)


@task(name="rollback-target", **RETRY)
def rollback_target(model: str, to_version: str | None) -> RollbackTarget:
    """The version a rollback goes to: the one asked for, or the newest known-good one that is not stable."""
    return phase.rollback_target(catalog(), model=model, to_version=to_version)


@task(name="open-rollout", **RETRY)
def open_rollout(
    model: str,
    kind: str,
    to_version: str,
    *,
    from_version: str | None,
    triggered_by: str,
    params: dict[str, Any],
    load: Loaded | None = None,
) -> int:
    """Start the record of a change. A rollback closes any rollout in progress (its loop then stops)."""
    origin = f"flow-run:{flow_run.id}:{kind}" if flow_run.id else None  # a retry finds its own record
    return phase.open_rollout(
        catalog(), model=model, kind=RolloutKind(kind), to_version=to_version, from_version=from_version,
        triggered_by=triggered_by, params=params, origin=origin, load=load,
    )  # fmt: skip


@task(name="deploy-version", timeout_seconds=900, **RETRY)
def deploy_version(
    model: str,
    run: str,
    step: int,
    *,
    version: str | None = None,
    handler: str | None = None,
    extra_files: list[str] | None = None,
) -> Loaded:
    """Export the verified checkpoint (once) and load it next to the stable version at weight 0."""
    return phase.deploy_version(
        catalog(), model=model, run=run, step=step, notify=notifier(), version=version, handler=handler,
        extra_files=extra_files,
    )  # fmt: skip


@task(name="shift-traffic", **RETRY)
def shift_traffic(model: str, weights: dict[str, int], rollout_id: int, actor: str) -> None:
    """Set the proxy weights (live, no reload) and record them."""
    phase.shift_traffic(catalog(), model=model, weights=weights, rollout_id=rollout_id, actor=actor)


@task(name="watch-canary", timeout_seconds=3600, **RETRY)
def watch_canary(
    model: str,
    version: str,
    rollout_id: int,
    window_s: float,
    gate_values: dict[str, Any],
    probe_set: str | None,
) -> Result:
    """Let traffic flow for one window, then judge the canary on it (and on one pass of probes)."""
    return phase.watch_canary(
        catalog(), model=model, version=version, rollout_id=rollout_id, window_s=window_s,
        gate_values=gate_values, probe_set=probe_set,
    )  # fmt: skip


@task(name="promote-version", **RETRY)
def promote_version(model: str, version: str, rollout_id: int, actor: str) -> str | None:
    """All traffic to ``version``, which becomes stable; the old stable stays loaded at weight 0."""
    return phase.promote_version(
        catalog(), model=model, version=version, rollout_id=rollout_id, actor=actor, notify=notifier()
    )


@task(name="switch-back", **RETRY)
def switch_back(
    model: str, to_version: str, rollout_id: int, *, actor: str, reason: str, decided_at: float
) -> Switched:
    """The rollback itself: every request to ``to_version`` now, in one weight change."""
    return phase.switch_back(
        catalog(), model=model, to_version=to_version, rollout_id=rollout_id, actor=actor, reason=reason,
        decided_at=decided_at, notify=notifier(),
    )  # fmt: skip


@task(name="unload-version", timeout_seconds=300, **RETRY)
def unload_version(model: str, version: str, rollout_id: int, state: str, actor: str) -> None:
    """Drain and unload a version no longer needed; its catalog state says why (retired, rolled back)."""
    phase.unload_version(
        catalog(), model=model, version=version, rollout_id=rollout_id, state=VersionState(state), actor=actor
    )


@task(name="finish-rollout", **RETRY)
def finish_rollout(
    rollout_id: int,
    state: str,
    reason: str | None = None,
    decided_at: float | None = None,
    switch_s: float | None = None,
) -> str:
    """Close the rollout record (unless a rollback already closed it) and publish its timeline; the
    state it has."""
    return phase.finish_rollout(
        catalog(), rollout_id=rollout_id, state=state, notify=notifier(), reason=reason, decided_at=decided_at,
        switch_s=switch_s,
    )  # fmt: skip


def still_running(rollout_id: int) -> bool:
    """False once someone else (a manual rollback) closed this rollout."""
    return phase.still_running(catalog(), rollout_id=rollout_id)
