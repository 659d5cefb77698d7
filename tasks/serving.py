"""Serving phase: export, load, shift traffic, judge, promote, roll back, unload.

Each task does one backend action and records it (catalog row + rollout step), so
the timeline is complete even when a flow dies half-way. Tasks return plain dicts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from infra import config, stopping
from infra.catalog import serving as sv
from infra.catalog.db import Catalog
from infra.catalog.models import VersionState as V
from infra.errors import ConfigError, NotFoundError, ServingUnavailable
from infra.serving import export, gates, stack
from infra.serving.backend import TorchServeBackend
from tasks.common import RETRY, artifact_key, catalog, emit_for_model


@contextlib.contextmanager
def backend() -> Iterator[TorchServeBackend]:
    b = TorchServeBackend(stack.load(config.serving_home()))
    try:
        yield b
    finally:
        b.close()


def _require_up(b: TorchServeBackend) -> None:
    if not b.ts.ping():
        raise ServingUnavailable(f"TorchServe at {b.stack.endpoints.inference} does not answer /ping")


@task(name="serving-state", **RETRY)
def serving_state(model: str) -> dict[str, Any]:
    """What serves ``model`` now, per the catalog; NotFoundError for a model never deployed."""
    rows = sv.versions(catalog(), model)
    return {
        "model": model,
        "stable": next((r.version for r in rows if r.state == V.STABLE), None),
        "loaded": {r.version: r.state for r in rows if r.state in sv.LOADED},
    }


@task(name="rollback-target", **RETRY)
def rollback_target(model: str, to_version: str | None) -> dict[str, Any]:
    """The version a rollback goes to: the one asked for, or the newest known-good one that is not stable.

    Only a version that once served all traffic (and was not rolled back since) is a
    target: going back to it needs no gates.
    """
    cat = catalog()
    rows = sv.versions(cat, model)
    current = next((r for r in rows if r.state == V.STABLE), None)
    if to_version is not None:
        row = sv.get_version(cat, model, to_version)
        if not row.was_stable:
            raise ConfigError(
                f"{model} {to_version} never served all traffic (or was rolled back); "
                "a rollback only goes to a known-good version: use a gated rollout for it"
            )
    elif current is not None and any(r.state == V.CANARY for r in rows):
        row = current  # a canary is taking traffic: back to the stable version
    else:
        good = [r for r in rows if r.was_stable and r.state in sv.KNOWN_GOOD and r.state != V.STABLE]
        if not good:
            raise NotFoundError(f"{model} has no earlier known-good version to roll back to")
        row = max(good, key=lambda r: r.promoted_at or r.created_at)
    canary = any(r.state == V.CANARY for r in rows)
    if current is not None and row.version == current.version and not canary:
        raise ConfigError(f"{model} {row.version} already serves all traffic")
    return {
        "version": row.version,
        "run": row.run,
        "step": row.step,
        "loaded": row.state in sv.LOADED,
        "current": current.version if current else None,
    }


@task(name="open-rollout", **RETRY)
def open_rollout(
    model: str,
    kind: str,
    to_version: str,
    *,
    from_version: str | None,
    triggered_by: str,
    params: dict[str, Any],
    load: dict[str, Any] | None = None,
) -> int:
    """Start the record of a change. A rollback closes any rollout in progress (its loop then stops)."""
    cat = catalog()
    origin = f"flow-run:{flow_run.id}:{kind}" if flow_run.id else None  # a retry finds its own record
    if origin is not None and (mine := sv.rollout_by_origin(cat, origin)) is not None:
        return mine
    running = sv.running_rollouts(cat, model)
    if running and kind != "rollback":
        raise ConfigError(
            f"a {running[0].kind} of {model} is already in progress (rollout {running[0].id}); "
            "wait for it or roll back"
        )
    rid = sv.begin_rollout(
        cat,
        model,
        kind,
        to_version,
        from_version=from_version,
        triggered_by=triggered_by,
        params=params,
        origin=origin,
    )
    for other in running:
        sv.record_step(cat, other.id, "interrupted", actor=triggered_by, detail=f"{kind} {rid} took over")
        sv.finish_rollout(cat, other.id, "rolled_back", reason=f"interrupted by {kind} {rid}")
    if load is not None:
        detail = f"loaded {to_version} from {load['run']}@{load['step']} in {load['load_s']}s"
        sv.record_step(cat, rid, "load", actor=triggered_by, passed=True, detail=detail)
    return rid


def _packaging(
    cat: Catalog, model: str, handler: str | None, extra_files: list[str] | None
) -> tuple[str, list[str]]:
    """The handler and files to pack: as given, else what the model's stable version was packed with."""
    recorded = sv.packaging(cat, model)
    if handler is None and recorded is None:
        raise ConfigError(
            f"model {model!r} has no handler yet: give its TorchServe handler file (--handler) "
            "and the files it imports (--extra-file) on its first deploy"
        )
    if handler is None and recorded is not None:
        handler = recorded[0]
    if extra_files is None:
        extra_files = recorded[1] if recorded is not None and handler == recorded[0] else []
    return str(Path(str(handler)).resolve()), [str(Path(f).resolve()) for f in extra_files]


@task(name="deploy-version", timeout_seconds=900, **RETRY)
def deploy_version(
    model: str,
    run: str,
    step: int,
    *,
    version: str | None = None,
    handler: str | None = None,
    extra_files: list[str] | None = None,
) -> dict[str, Any]:
    """Export the verified checkpoint (once) and load it next to the stable version at weight 0."""
    cat = catalog()
    pack_handler, pack_files = _packaging(cat, model, handler, extra_files)
    with backend() as b:
        _require_up(b)  # before anything is written: a dead server leaves no version behind
        row = sv.find_version(cat, model, version=version, run=run, step=step)
        if row is None:
            art = export.export(
                cat,
                run=run,
                step=step,
                model=model,
                version=version or sv.next_version(cat, model),
                handler=Path(pack_handler),
                extra_files=[Path(f) for f in pack_files],
                store=b.stack.endpoints.model_store,
            )
            sv.add_version(
                cat,
                model=model,
                version=art.version,
                checkpoint_id=art.checkpoint_id,
                run=art.run,
                step=art.step,
                manifest_digest=art.manifest_digest,
                artifact_uri=str(art.archive),
                handler=pack_handler,
                extra_files=pack_files,
                artifact_digest=art.digest,
                artifact_bytes=art.bytes,
            )
            row = sv.get_version(cat, model, art.version)
        elif (row.run, row.step) != (run, step):
            raise ConfigError(f"{model} {row.version} came from {row.run}@{row.step}, not {run}@{step}")
        started = time.perf_counter()
        try:
            b.deploy(model, row.version, Path(row.artifact_uri).name)
        except Exception:
            sv.set_state(cat, model, row.version, V.FAILED, expect=(V.EXPORTED, V.FAILED))
            raise
        sv.set_state(
            cat, model, row.version, V.LOADED, expect=(V.EXPORTED, V.FAILED, V.RETIRED, V.ROLLED_BACK)
        )
        load_s = time.perf_counter() - started
    out = {
        "model": model,
        "version": row.version,
        "run": run,
        "step": step,
        "load_s": round(load_s, 3),
        "artifact_digest": row.artifact_digest,
        "manifest_digest": row.manifest_digest,
    }
    emit_for_model("rewind.serving.loaded", model, out)
    return out


@task(name="shift-traffic", **RETRY)
def shift_traffic(model: str, weights: dict[str, int], rollout_id: int, actor: str) -> dict[str, Any]:
    """Set the proxy weights (live, no reload) and record them."""
    cat = catalog()
    with backend() as b:
        b.set_traffic(model, weights)
    sv.set_weights(cat, model, weights)
    for v, w in weights.items():
        if w > 0:
            sv.set_state(cat, model, v, V.CANARY, expect=(V.LOADED,))
    sv.record_step(cat, rollout_id, "set_traffic", actor=actor, weights=weights)
    return {"model": model, "weights": weights}


@task(name="watch-canary", timeout_seconds=3600, **RETRY)
def watch_canary(
    model: str,
    version: str,
    rollout_id: int,
    window_s: float,
    gate_values: dict[str, Any],
    probe_set: str | None,
) -> dict[str, Any]:
    """Let traffic flow for one window, then judge the canary on it (and on one pass of probes)."""
    g = gates.Gates(**gate_values)
    probes = gates.load_probes(Path(probe_set)) if probe_set else []
    with backend() as b:
        before = b.counters(model).get(version)
        stopping.sleep(window_s)  # the bake: real traffic reaches the canary meanwhile (SIGTERM ends it)
        if version not in b.loaded(model):  # unloaded meanwhile (a manual rollback): nothing to judge
            return {"passed": False, "reasons": [f"{version} is no longer loaded"]}
        after = b.counters(model).get(version)
        result = gates.evaluate(b, model, version, g, probes, traffic_before=before, traffic_after=after)
    out = result.as_dict()
    sv.record_step(
        catalog(), rollout_id, "gate", actor="gates", gates=out, passed=result.passed,
        detail="; ".join(result.reasons) or None,
    )  # fmt: skip
    return out


@task(name="promote-version", **RETRY)
def promote_version(model: str, version: str, rollout_id: int, actor: str) -> dict[str, Any]:
    """All traffic to ``version``, which becomes stable; the old stable stays loaded at weight 0."""
    cat = catalog()
    others = [r.version for r in sv.versions(cat, model, sv.LOADED) if r.version != version]
    weights = {version: 100, **dict.fromkeys(others, 0)}
    with backend() as b:
        b.set_traffic(model, weights)
    old = sv.promote(cat, model, version)
    sv.record_step(cat, rollout_id, "promote", actor=actor, weights=weights, detail=f"previous stable: {old}")
    emit_for_model(
        "rewind.rollout.promoted", model, {"version": version, "previous": old, "rollout_id": rollout_id}
    )
    return {"model": model, "version": version, "previous": old}


@task(name="switch-back", **RETRY)
def switch_back(
    model: str, to_version: str, rollout_id: int, *, actor: str, reason: str, decided_at: float
) -> dict[str, Any]:
    """The rollback itself: every request to ``to_version`` now, in one weight change.

    ``decided_at`` (epoch seconds) is when the flow decided; the switch time is
    measured from then until the proxy has the new weights.
    """
    cat = catalog()
    loaded = [r.version for r in sv.versions(cat, model, sv.LOADED)]
    weights = {to_version: 100, **{v: 0 for v in loaded if v != to_version}}
    with backend() as b:
        b.set_traffic(model, weights)  # NotFoundError if the target is not loaded
    switched_at = time.time()
    sv.set_weights(cat, model, weights)
    old = sv.promote(cat, model, to_version)
    sv.record_step(cat, rollout_id, "rollback", actor=actor, weights=weights, detail=reason)
    switch_s = switched_at - decided_at
    out = {
        "model": model,
        "version": to_version,
        "from": old,
        "reason": reason,
        "switch_s": round(switch_s, 4),
        "decided_at": decided_at,
        "switched_at": switched_at,
        "rollout_id": rollout_id,
    }
    emit_for_model("rewind.rollout.rolled_back", model, out)
    return out


@task(name="unload-version", timeout_seconds=300, **RETRY)
def unload_version(model: str, version: str, rollout_id: int, state: str, actor: str) -> dict[str, Any]:
    """Drain and unload a version no longer needed; its catalog state says why (retired, rolled back)."""
    with backend() as b:
        b.undeploy(model, version)
    cat = catalog()
    sv.set_state(cat, model, version, V(state), expect=sv.LOADED)
    sv.record_step(cat, rollout_id, "unload", actor=actor, detail=f"{version} -> {state}")
    return {"model": model, "version": version, "state": state}


@task(name="finish-rollout", **RETRY)
def finish_rollout(
    rollout_id: int,
    state: str,
    reason: str | None = None,
    decided_at: float | None = None,
    switch_s: float | None = None,
) -> dict[str, Any]:
    """Close the rollout record (unless a rollback already closed it) and publish its timeline."""
    cat = catalog()
    when = datetime.fromtimestamp(decided_at, UTC) if decided_at else None
    state = sv.finish_rollout(cat, rollout_id, state, reason=reason, decided_at=when, switch_s=switch_s)
    ro = sv.get_rollout(cat, rollout_id)
    rows = [
        {
            "at": s.at.isoformat(timespec="milliseconds"),
            "action": s.action,
            "actor": s.actor,
            "weights": s.weights,
            "passed": s.passed,
            "detail": s.detail,
        }
        for s in sv.steps_of(cat, rollout_id)
    ]
    create_table_artifact(
        key=artifact_key("rewind", ro.model, "rollout"),
        table=rows,
        description=f"{ro.kind} of {ro.model} {ro.from_version} -> {ro.to_version}: {state}"
        + (f" ({reason})" if reason else ""),
    )
    return {"rollout_id": rollout_id, "state": state, "steps": len(rows)}


def still_running(rollout_id: int) -> bool:
    """False once someone else (a manual rollback) closed this rollout."""
    return sv.get_rollout(catalog(), rollout_id).state == "running"
