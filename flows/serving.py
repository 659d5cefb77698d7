"""Serving flows: deploy a model version, roll it out under gates, roll back in one weight change.

The flow owns the rollout loop (traffic steps, bake windows, gates, failure
limit); the backend only loads versions and sets weights. The previous stable
version stays loaded through the whole rollout, so every rollback is a routing
change, measured from the flow's decision to the proxy taking the new weights.
"""

from __future__ import annotations

import contextlib
import getpass
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.runtime import deployment, flow_run

from rewind.infra.errors import ConfigError, Stopped
from rewind.infra.serving.gates import Gates
from rewind.tasks.serving import (
    deploy_version,
    finish_rollout,
    open_rollout,
    promote_version,
    rollback_target,
    serving_state,
    shift_traffic,
    still_running,
    switch_back,
    unload_version,
    watch_canary,
)


def _actor(triggered_by: str | None) -> str:
    """Who started this: the caller's word, else the Prefect deployment/automation, else the OS user."""
    if triggered_by:
        return triggered_by
    if deployment.name:
        return f"deployment {deployment.name} (flow run {flow_run.name})"
    return f"user {os.environ.get('USER') or getpass.getuser()}"


def _check_steps(steps: list[int]) -> list[int]:
    ok = steps and all(0 < s <= 100 for s in steps) and steps == sorted(set(steps)) and steps[-1] == 100
    if not ok:
        raise ConfigError(f"traffic_steps must rise strictly within 1-100 and end at 100, got {steps}")
    return steps


def _gate_values(
    max_error_rate: float, max_p95_latency_ms: float, min_quality: float | None, probe_set: str | None
) -> dict[str, Any]:
    """The gates' thresholds, checked before anything is loaded."""
    Gates(max_error_rate=max_error_rate, max_p95_latency_ms=max_p95_latency_ms, min_quality=min_quality)
    if min_quality is not None and not probe_set:
        raise ConfigError("min_quality needs a probe_set (JSON lines of input and expected output)")
    return {
        "max_error_rate": max_error_rate,
        "max_p95_latency_ms": max_p95_latency_ms,
        "min_quality": min_quality,
    }


@flow(name="deploy-model")
def deploy_model(
    model: str,
    run: str,
    step: int,
    version: str | None = None,
    handler: str | None = None,
    extra_files: list[str] | None = None,
    triggered_by: str | None = None,
) -> dict[str, Any]:
    """Export a verified checkpoint and load it. The model's first version takes all traffic at once;
    a later one waits, loaded at weight 0, for `rollout-model`."""
    actor = _actor(triggered_by)
    loaded = deploy_version(model, run, step, version=version, handler=handler, extra_files=extra_files)
    stable = serving_state(model).stable  # the model exists now: deploy_version recorded it
    v = loaded.version
    rid = open_rollout(
        model,
        "deploy",
        v,
        from_version=stable,
        triggered_by=actor,
        params={"run": run, "step": step},
        load=loaded,
    )
    if stable is None:
        promote_version(model, v, rid, actor)
    finish_rollout(rid, "promoted" if stable is None else "done")
    return {**loaded.as_dict(), "stable": v if stable is None else stable, "rollout_id": rid}


@flow(name="rollout-model")
def rollout_model(
    model: str,
    run: str,
    step: int,
    traffic_steps: list[int] = [10, 50, 100],  # noqa: B006 (Prefect parameters are copied per run)
    bake_s: float = 60.0,
    checks_per_step: int = 1,
    max_error_rate: float = 0.05,
    max_p95_latency_ms: float = 1000.0,
    min_quality: float | None = None,
    probe_set: str | None = None,
    failure_limit: int = 0,
    version: str | None = None,
    handler: str | None = None,
    extra_files: list[str] | None = None,
    triggered_by: str | None = None,
    warm_s: float = 120.0,
) -> dict[str, Any]:
    """Canary a checkpoint of `run` at `step` against the stable version of `model`.

    Traffic goes through `traffic_steps` percent; each step bakes `bake_s` seconds,
    judged `checks_per_step` times on error rate (real traffic and probes), p95
    latency and, with a JSONL `probe_set`, quality. More than `failure_limit`
    failed checks roll back to the stable version at once and emit
    `rewind.rollout.rolled_back`; passing every step promotes the canary. The old
    version then stays loaded at weight 0 for `warm_s` seconds while the same gates
    keep watching the new one: a failure in that window is still one weight change
    back (reason `post-promotion: ...`). Only then is the old version unloaded.
    """
    _check_steps(traffic_steps)
    gate_values = _gate_values(max_error_rate, max_p95_latency_ms, min_quality, probe_set)
    if checks_per_step < 1 or failure_limit < 0 or bake_s <= 0 or warm_s < 0:
        raise ConfigError("checks_per_step >= 1, failure_limit >= 0, bake_s > 0 and warm_s >= 0 are required")
    actor = _actor(triggered_by)
    stable = serving_state(model).stable
    if stable is None:
        raise ConfigError(f"{model} has no stable version to canary against; deploy its first version")
    loaded = deploy_version(model, run, step, version=version, handler=handler, extra_files=extra_files)
    new = loaded.version
    if new == stable:
        raise ConfigError(f"{model} {new} ({run}@{step}) is already the stable version")
    params = {
        "run": run,
        "step": step,
        "traffic_steps": traffic_steps,
        "bake_s": bake_s,
        "checks_per_step": checks_per_step,
        "failure_limit": failure_limit,
        "probe_set": probe_set,
        "warm_s": warm_s,
        **gate_values,
    }
    rid = open_rollout(
        model, "rollout", new, from_version=stable, triggered_by=actor, params=params, load=loaded
    )

    judge = _Judge(model, new, stable, rid, gate_values, probe_set, checks_per_step, failure_limit)
    return _roll_out(judge, actor, traffic_steps, bake_s, warm_s)


def _roll_out(
    judge: _Judge, actor: str, traffic_steps: list[int], bake_s: float, warm_s: float
) -> dict[str, Any]:
    """The canary's walk, promotion and warm window; whatever breaks or stops it, nothing is left
    half-rolled-out."""
    model, new, stable, rid, checks_per_step = judge.model, judge.new, judge.stable, judge.rid, judge.checks
    try:
        ended = _walk(judge, actor, traffic_steps, bake_s)
        if ended is None:
            promote_version(model, new, rid, actor)
            # the warm window is judged at the canary's cadence: a window as long as one canary check
            windows = max(1, math.ceil(warm_s * checks_per_step / bake_s))
            ended = judge.bake(warm_s, "post-promotion: gates failed", windows) if warm_s > 0 else None
    except BaseException as exc:
        # Whatever broke (a task out of retries, a dead proxy) or stopped it (SIGTERM, Ctrl-C), the stable
        # version gets the traffic back, the canary is unloaded and the record is closed, so nothing is
        # left half-rolled-out.
        why = "stopped" if isinstance(exc, Stopped) or not isinstance(exc, Exception) else "failed"
        reason = f"rollout {why}: {type(exc).__name__}: {exc}"[:2000]
        with contextlib.suppress(Exception):
            switch_back(model, stable, rid, actor="rollout-model", reason=reason, decided_at=time.time())
        with contextlib.suppress(Exception):
            unload_version(model, new, rid, "rolled_back", "rollout-model")
        finish_rollout(rid, "failed", reason)
        raise
    if ended is not None:
        return ended
    unload_version(model, stable, rid, "retired", actor)  # after the warm window, as promised
    finish_rollout(rid, "promoted")
    return {"rollout_id": rid, "state": "promoted", "version": new, "previous": stable}


@dataclass
class _Judge:
    """One rollout's gates: judged in windows, failures counted across the whole rollout."""

    model: str
    new: str
    stable: str
    rid: int
    gate_values: dict[str, Any]
    probe_set: str | None
    checks: int
    failure_limit: int
    failures: int = 0

    def bake(self, seconds: float, where: str, windows: int | None = None) -> dict[str, Any] | None:
        """Watch ``seconds`` in ``windows`` (default ``checks``) windows; the rollout's end if it ended,
        None if every check passed."""
        n = windows or self.checks
        for _ in range(n):
            verdict = watch_canary(self.model, self.new, self.rid, seconds / n, self.gate_values,
                                   self.probe_set)  # fmt: skip
            if not still_running(self.rid):  # a manual rollback took over meanwhile
                return {"rollout_id": self.rid, "state": "interrupted", "version": self.new}
            if not verdict.passed:
                self.failures += 1
                if self.failures > self.failure_limit:
                    return self.roll_back(f"{where}: " + "; ".join(verdict.reasons))
        return None

    def roll_back(self, reason: str) -> dict[str, Any]:
        decided = time.time()
        switched = switch_back(
            self.model, self.stable, self.rid, actor="gates", reason=reason, decided_at=decided
        )
        unload_version(self.model, self.new, self.rid, "rolled_back", "gates")
        finish_rollout(self.rid, "rolled_back", reason, decided, switched.switch_s)
        return {
            "rollout_id": self.rid,
            "state": "rolled_back",
            "version": self.new,
            "stable": self.stable,
            "reason": reason,
            "switch_s": switched.switch_s,
            "failures": self.failures,
        }


def _walk(judge: _Judge, actor: str, traffic_steps: list[int], bake_s: float) -> dict[str, Any] | None:
    """The rollout loop: traffic steps and their bake windows. None: every check passed."""
    for pct in traffic_steps:
        shift_traffic(judge.model, {judge.new: pct, judge.stable: 100 - pct}, judge.rid, actor)
        ended = judge.bake(bake_s, f"gates failed at {pct}%")
        if ended is not None:
            return ended
    return None


@flow(name="rollback-model")
def rollback_model(
    model: str,
    to_version: str | None = None,
    reason: str = "manual rollback",
    triggered_by: str | None = None,
) -> dict[str, Any]:
    """Send all traffic back to a known-good version of `model` (default: the previous stable one).

    No gates: the target already served all traffic. When it is still loaded (within a
    rollout, or until the bake after a promotion ends) this is one weight change;
    otherwise it is loaded first. Any rollout in progress stops.
    """
    actor = _actor(triggered_by)
    target = rollback_target(model, to_version)
    v = target.version
    rid = open_rollout(
        model, "rollback", v, from_version=target.current, triggered_by=actor, params={"reason": reason}
    )
    if not target.loaded:
        deploy_version(model, target.run, target.step, version=v)
    serving = serving_state(model).loaded  # taking traffic now: what is rolled back
    decided = time.time()
    switched = switch_back(model, v, rid, actor=actor, reason=reason, decided_at=decided)
    for other, state in serving.items():
        if other != v and state in ("canary", "stable"):
            unload_version(model, other, rid, "rolled_back", actor)
    finish_rollout(rid, "rolled_back", reason, decided, switched.switch_s)
    return {
        "rollout_id": rid,
        "state": "rolled_back",
        "version": v,
        "from": target.current,
        "switch_s": switched.switch_s,
        "decided_at": decided,
    }
