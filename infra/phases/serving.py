"""Serving's phases: deploy a version next to the stable one, move traffic, judge, promote, switch back.

Each is one step of the deploy, rollout and rollback flows, recorded on the rollout it
belongs to (``catalog.serving``); the backend (TorchServe behind HAProxy) only loads
versions and sets weights. A rollback is one weight change to a version that is still
loaded, measured from the decision to the proxy taking the new weights.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rewind.infra import config, stopping
from rewind.infra.catalog import serving as sv
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import RolloutKind
from rewind.infra.catalog.models import VersionState as V
from rewind.infra.errors import ConfigError, NotFoundError, ServingUnavailable
from rewind.infra.phases.notify import Notifier, artifact_key, model_event
from rewind.infra.serving import export, gates, stack
from rewind.infra.serving.backend import TorchServeBackend


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


@dataclass(frozen=True, slots=True)
class ServingState:
    model: str
    stable: str | None
    loaded: Mapping[str, str]  # version -> its state, for every version loaded


@dataclass(frozen=True, slots=True)
class RollbackTarget:
    version: str
    run: str
    step: int
    loaded: bool  # still loaded: the rollback is one weight change
    current: str | None  # the stable version now


@dataclass(frozen=True, slots=True)
class Loaded:
    """A version loaded next to the stable one, at weight 0."""

    model: str
    version: str
    run: str
    step: int
    load_s: float
    artifact_digest: str | None
    manifest_digest: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Switched:
    """A rollback's weight change: every request to ``version`` from ``switched_at`` on."""

    model: str
    version: str
    previous: str | None
    reason: str
    switch_s: float
    decided_at: float
    switched_at: float
    rollout_id: int


def serving_state(cat: Catalog, *, model: str) -> ServingState:
    """What serves ``model`` now, per the catalog; NotFoundError for a model never deployed."""
    rows = sv.versions(cat, model)
    stable = next((r.version for r in rows if r.state == V.STABLE), None)
    return ServingState(model, stable, {r.version: str(r.state) for r in rows if r.state in sv.LOADED})


def rollback_target(cat: Catalog, *, model: str, to_version: str | None) -> RollbackTarget:
    """The version a rollback goes to: the one asked for, or the newest known-good one that is not stable.

    Only a version that once served all traffic (and was not rolled back since) is a
    target: going back to it needs no gates.
    """
    rows = sv.versions(cat, model)
    current = next((r for r in rows if r.state == V.STABLE), None)
    canary = any(r.state == V.CANARY for r in rows)
    if to_version is not None:
        row = sv.get_version(cat, model, to_version)
        if not row.was_stable:
            raise ConfigError(
                f"{model} {to_version} never served all traffic (or was rolled back); "
                "a rollback only goes to a known-good version: use a gated rollout for it"
            )
    elif current is not None and canary:
        row = current  # a canary is taking traffic: back to the stable version
    else:
        good = [r for r in rows if r.was_stable and r.state in sv.KNOWN_GOOD and r.state != V.STABLE]
        if not good:
            raise NotFoundError(f"{model} has no earlier known-good version to roll back to")
        row = max(good, key=lambda r: r.promoted_at or r.created_at)
    if current is not None and row.version == current.version and not canary:
        raise ConfigError(f"{model} {row.version} already serves all traffic")
    return RollbackTarget(
        row.version, row.run, row.step, row.state in sv.LOADED, current.version if current else None
    )


def open_rollout(
    cat: Catalog,
    *,
    model: str,
    kind: RolloutKind,
    to_version: str,
    from_version: str | None,
    triggered_by: str,
    params: Mapping[str, Any],
    origin: str | None,
    load: Loaded | None = None,
) -> int:
    """Start the record of a change; a retry with the same ``origin`` finds its own record. A rollback
    closes any rollout in progress (its loop then stops)."""
    if origin is not None and (mine := sv.rollout_by_origin(cat, origin)) is not None:
        return mine
    running = sv.running_rollouts(cat, model)
    if running and kind is not RolloutKind.ROLLBACK:
        raise ConfigError(
            f"a {running[0].kind} of {model} is already in progress (rollout {running[0].id}); "
            "wait for it or roll back"
        )
    rid = sv.begin_rollout(
        cat, model, kind, to_version, from_version=from_version, triggered_by=triggered_by,
        params=dict(params), origin=origin,
    )  # fmt: skip
    for other in running:
        sv.record_step(cat, other.id, "interrupted", actor=triggered_by, detail=f"{kind} {rid} took over")
        sv.finish_rollout(cat, other.id, "rolled_back", reason=f"interrupted by {kind} {rid}")
    if load is not None:
        detail = f"loaded {to_version} from {load.run}@{load.step} in {load.load_s}s"
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
    packed = str(Path(str(handler)).resolve()), [str(Path(f).resolve()) for f in extra_files]
    for what, path in (("handler", packed[0]), *(("extra file", f) for f in packed[1])):
        if not Path(path).is_file():  # before anything is exported, not torch-model-archiver's error after
            raise ConfigError(
                f"the {what} {path} is not a file (a relative path is taken from the directory the deploy "
                f"runs in, {Path.cwd()}; the wheel's examples: python -c 'import rewind.examples as e; "
                "print(e.__path__[0])')"
            )
    return packed


def _exported(
    cat: Catalog,
    b: TorchServeBackend,
    model: str,
    run: str,
    step: int,
    version: str | None,
    packing: tuple[str, list[str]],
) -> Any:
    """The version's catalog row, exported from the verified checkpoint first if it has none yet."""
    row = sv.find_version(cat, model, version=version, run=run, step=step)
    if row is not None:
        if (row.run, row.step) != (run, step):
            raise ConfigError(f"{model} {row.version} came from {row.run}@{row.step}, not {run}@{step}")
        return row
    handler, files = packing
    art = export.export(
        cat, run=run, step=step, model=model, version=version or sv.next_version(cat, model),
        handler=Path(handler), extra_files=[Path(f) for f in files], store=b.stack.endpoints.model_store,
    )  # fmt: skip
    sv.add_version(
        cat, model=model, version=art.version, checkpoint_id=art.checkpoint_id, run=art.run, step=art.step,
        manifest_digest=art.manifest_digest, artifact_uri=str(art.archive), handler=handler, extra_files=files,
        artifact_digest=art.digest, artifact_bytes=art.bytes,
    )  # fmt: skip
    return sv.get_version(cat, model, art.version)


def deploy_version(
    cat: Catalog,
    *,
    model: str,
    run: str,
    step: int,
    notify: Notifier,
    version: str | None = None,
    handler: str | None = None,
    extra_files: list[str] | None = None,
) -> Loaded:
    """Export the verified checkpoint (once) and load it next to the stable version at weight 0."""
    packing = _packaging(cat, model, handler, extra_files)
    with backend() as b:
        _require_up(b)  # before anything is written: a dead server leaves no version behind
        row = _exported(cat, b, model, run, step, version, packing)
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
    loaded = Loaded(model, row.version, run, step, round(load_s, 3), row.artifact_digest, row.manifest_digest)
    notify.event(model_event("rewind.serving.loaded", model, loaded.as_dict()))
    return loaded


def shift_traffic(
    cat: Catalog, *, model: str, weights: Mapping[str, int], rollout_id: int, actor: str
) -> None:
    """Set the proxy weights (live, no reload) and record them."""
    with backend() as b:
        b.set_traffic(model, dict(weights))
    sv.set_weights(cat, model, dict(weights))
    for v, w in weights.items():
        if w > 0:
            sv.set_state(cat, model, v, V.CANARY, expect=(V.LOADED,))
    sv.record_step(cat, rollout_id, "set_traffic", actor=actor, weights=dict(weights))


def watch_canary(
    cat: Catalog,
    *,
    model: str,
    version: str,
    rollout_id: int,
    window_s: float,
    gate_values: Mapping[str, Any],
    probe_set: str | None,
) -> gates.Result:
    """Let traffic flow for one window, then judge the canary on it (and on one pass of probes)."""
    g = gates.Gates(**gate_values)
    probes = gates.load_probes(Path(probe_set)) if probe_set else []
    with backend() as b:
        before = b.counters(model).get(version)
        stopping.sleep(window_s)  # the bake: real traffic reaches the canary meanwhile (SIGTERM ends it)
        if version not in b.loaded(model):  # unloaded meanwhile (a manual rollback): nothing to judge
            return gates.Result(False, 0, 0, None, None, None, [f"{version} is no longer loaded"])
        after = b.counters(model).get(version)
        result = gates.evaluate(b, model, version, g, probes, traffic_before=before, traffic_after=after)
    sv.record_step(
        cat, rollout_id, "gate", actor="gates", gates=result.as_dict(), passed=result.passed,
        detail="; ".join(result.reasons) or None,
    )  # fmt: skip
    return result


def promote_version(
    cat: Catalog, *, model: str, version: str, rollout_id: int, actor: str, notify: Notifier
) -> str | None:
    """All traffic to ``version``, which becomes stable; the old stable (returned) stays loaded at weight 0."""
    others = [r.version for r in sv.versions(cat, model, sv.LOADED) if r.version != version]
    weights = {version: 100, **dict.fromkeys(others, 0)}
    with backend() as b:
        b.set_traffic(model, weights)
    old = sv.promote(cat, model, version)
    sv.record_step(cat, rollout_id, "promote", actor=actor, weights=weights, detail=f"previous stable: {old}")
    payload = {"version": version, "previous": old, "rollout_id": rollout_id}
    notify.event(model_event("rewind.rollout.promoted", model, payload))
    return old


def switch_back(
    cat: Catalog,
    *,
    model: str,
    to_version: str,
    rollout_id: int,
    actor: str,
    reason: str,
    decided_at: float,
    notify: Notifier,
) -> Switched:
    """The rollback itself: every request to ``to_version`` now, in one weight change, timed from
    ``decided_at`` (epoch seconds, when the flow decided) until the proxy has the new weights."""
    loaded = [r.version for r in sv.versions(cat, model, sv.LOADED)]
    weights = {to_version: 100, **{v: 0 for v in loaded if v != to_version}}
    with backend() as b:
        b.set_traffic(model, weights)  # NotFoundError if the target is not loaded
    switched_at = time.time()
    sv.set_weights(cat, model, weights)
    old = sv.promote(cat, model, to_version)
    sv.record_step(cat, rollout_id, "rollback", actor=actor, weights=weights, detail=reason)
    done = Switched(
        model,
        to_version,
        old,
        reason,
        round(switched_at - decided_at, 4),
        decided_at,
        switched_at,
        rollout_id,
    )
    payload = {**asdict(done), "from": old}
    del payload["previous"]
    notify.event(model_event("rewind.rollout.rolled_back", model, payload))
    return done


def unload_version(cat: Catalog, *, model: str, version: str, rollout_id: int, state: V, actor: str) -> None:
    """Drain and unload a version no longer needed; its catalog state says why (retired, rolled back)."""
    with backend() as b:
        b.undeploy(model, version)
    sv.set_state(cat, model, version, state, expect=sv.LOADED)
    sv.record_step(cat, rollout_id, "unload", actor=actor, detail=f"{version} -> {state}")


def finish_rollout(
    cat: Catalog,
    *,
    rollout_id: int,
    state: str,
    notify: Notifier,
    reason: str | None = None,
    decided_at: float | None = None,
    switch_s: float | None = None,
) -> str:
    """Close the rollout record (unless a rollback already closed it: its state is returned) and publish
    its timeline."""
    when = datetime.fromtimestamp(decided_at, UTC) if decided_at else None
    state = sv.finish_rollout(cat, rollout_id, state, reason=reason, decided_at=when, switch_s=switch_s)
    ro = sv.get_rollout(cat, rollout_id)
    rows = [
        {
            "at": s.at.isoformat(timespec="milliseconds"), "action": s.action, "actor": s.actor,
            "weights": s.weights, "passed": s.passed, "detail": s.detail,
        }
        for s in sv.steps_of(cat, rollout_id)
    ]  # fmt: skip
    notify.table(
        key=artifact_key("rewind", ro.model, "rollout"),
        rows=rows,
        description=f"{ro.kind} of {ro.model} {ro.from_version} -> {ro.to_version}: {state}"
        + (f" ({reason})" if reason else ""),
    )
    return state


def still_running(cat: Catalog, *, rollout_id: int) -> bool:
    """False once someone else (a manual rollback) closed this rollout."""
    return sv.get_rollout(cat, rollout_id).state == "running"
