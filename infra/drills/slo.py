"""Recovery SLOs (``rewind-slo.yaml``): per failure kind, an RTO and a replay budget, optionally per phase.

    defaults: {rto_s: 600, max_replay_steps: 500}
    kinds:
      crash: {rto_s: 120, max_replay_steps: 20, phases: {restore: 30}}

A drill passes when its recovery ran every phase, its RTO is within ``rto_s`` and it replayed at most
``max_replay_steps``. When it does not, the verdict names one phase: the phase that failed, the first
phase over its own budget, replay for a replay over budget, or else the phase that took longest (the one
that spent the RTO budget).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewind.infra import yaml_file
from rewind.infra.errors import ConfigError

PHASES = ("detect", "decide", "restore", "rebuild", "relaunch", "first_step", "replay")
# A serving drill's phases: an instance back answering after a kill; a bad version's gates failing
# (detect) and the traffic back on the stable version (rollback).
SERVING_PHASES = ("detect", "restart", "rollback")
ALL_PHASES = (*PHASES, *(p for p in SERVING_PHASES if p not in PHASES))
DEFAULT_RTO_S = 600.0  # the seeds' example: resume within 10 minutes
DEFAULT_MAX_REPLAY = 500
ENV = "REWIND_SLO_FILE"


@dataclass(frozen=True)
class Budget:
    rto_s: float = DEFAULT_RTO_S
    max_replay_steps: int = DEFAULT_MAX_REPLAY
    phases: dict[str, float] = field(default_factory=dict)
    max_failed_requests: int = 0  # serving drills: client requests that may fail through the fault

    def as_dict(self) -> dict[str, Any]:
        return {"rto_s": self.rto_s, "max_replay_steps": self.max_replay_steps, "phases": dict(self.phases),
                "max_failed_requests": self.max_failed_requests}  # fmt: skip


@dataclass(frozen=True)
class SLOs:
    default: Budget
    kinds: dict[str, Budget]
    source: str

    def for_kind(self, kind: str) -> Budget:
        return self.kinds.get(kind, self.default)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    failed_phase: str | None
    reason: str | None


def default_path() -> Path:
    return Path(os.environ.get(ENV, "rewind-slo.yaml"))


def load(path: str | Path | None = None) -> SLOs:
    """The SLOs in ``path`` (default ``$REWIND_SLO_FILE`` or ./rewind-slo.yaml); built-in defaults without one."""
    p = Path(path) if path is not None else default_path()
    if not p.exists():
        if path is not None:
            raise ConfigError(f"SLO file {p} does not exist")
        return SLOs(Budget(), {}, "built-in defaults")
    raw = yaml_file.read(p, "SLO file") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"SLO file {p}: expected a mapping with 'defaults' and 'kinds'")
    default = _budget(raw.get("defaults") or {}, Budget(), f"{p}: defaults")
    kinds = {
        str(k): _budget(v or {}, default, f"{p}: kinds.{k}") for k, v in (raw.get("kinds") or {}).items()
    }
    return SLOs(default, kinds, str(p))


def _budget(raw: Any, base: Budget, where: str) -> Budget:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = set(raw) - {"rto_s", "max_replay_steps", "phases", "max_failed_requests"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    phases = raw.get("phases") or {}
    if not isinstance(phases, dict) or set(phases) - set(ALL_PHASES):
        raise ConfigError(f"{where}: phases must map some of {ALL_PHASES} to seconds")
    try:
        rto = float(raw.get("rto_s", base.rto_s))
        replay = int(raw.get("max_replay_steps", base.max_replay_steps))
        failed = int(raw.get("max_failed_requests", base.max_failed_requests))
        per_phase = {str(k): float(v) for k, v in phases.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if rto <= 0 or replay < 0 or failed < 0 or any(v <= 0 for v in per_phase.values()):
        raise ConfigError(f"{where}: budgets must be positive")
    return Budget(rto, replay, per_phase, failed)


def judge(
    budget: Budget, phases: dict[str, dict[str, Any]], rto_s: float | None, replayed: int | None
) -> Verdict:
    """Pass or fail ``phases`` (``{name: {"s": float|None, "status": str, "why"?: str}}``), marking each
    phase's status in place (``over_budget`` where it broke its own budget)."""
    for name in PHASES:
        ph = phases.get(name) or {}
        if ph.get("status") == "failed":
            return Verdict(False, name, ph.get("why") or f"{name} failed")
    for name in PHASES:
        limit, s = budget.phases.get(name), (phases.get(name) or {}).get("s")
        if limit is not None and s is not None and s > limit:
            phases[name]["status"] = "over_budget"
            return Verdict(False, name, f"{name} took {s:.2f} s, over its budget of {limit:g} s")
    if replayed is not None and replayed > budget.max_replay_steps:
        phases.setdefault("replay", {"s": None, "status": "not_measured"})["status"] = "over_budget"
        return Verdict(
            False, "replay", f"replayed {replayed} steps, over the budget of {budget.max_replay_steps}"
        )
    if rto_s is None:
        return Verdict(False, "first_step", "the job never took a step after recovery (no RTO)")
    if rto_s > budget.rto_s:
        timed = {n: (phases.get(n) or {}).get("s") for n in PHASES if n != "replay"}
        worst = max((n for n in timed if timed[n] is not None), key=lambda n: timed[n] or 0.0, default=None)
        if worst is not None:
            phases[worst]["status"] = "over_budget"
        return Verdict(
            False,
            worst,
            f"RTO {rto_s:.2f} s over the budget of {budget.rto_s:g} s"
            + (f"; {worst} took longest ({timed[worst]:.2f} s)" if worst else ""),
        )
    return Verdict(True, None, None)


def judge_serving(
    budget: Budget, phases: dict[str, dict[str, Any]], rto_s: float | None, failed_requests: int | None
) -> Verdict:
    """Pass or fail a serving drill: every phase ran, each within its own budget, no more client requests
    failed than ``max_failed_requests``, the time to full service (``rto_s``) within ``rto_s``."""
    for name in SERVING_PHASES:
        ph = phases.get(name) or {}
        if ph.get("status") == "failed":
            return Verdict(False, name, ph.get("why") or f"{name} failed")
    timed = {n: (phases.get(n) or {}).get("s") for n in SERVING_PHASES if phases.get(n)}
    for name, s in timed.items():
        limit = budget.phases.get(name)
        if limit is not None and s is not None and s > limit:
            phases[name]["status"] = "over_budget"
            return Verdict(False, name, f"{name} took {s:.2f} s, over its budget of {limit:g} s")
    worst = max((n for n in timed if timed[n] is not None), key=lambda n: timed[n] or 0.0, default=None)
    if failed_requests is None or rto_s is None:
        return Verdict(False, worst, "nothing was measured")
    if failed_requests > budget.max_failed_requests:
        return Verdict(False, worst, f"{failed_requests} client requests failed, over the budget of "
                       f"{budget.max_failed_requests}")  # fmt: skip
    if rto_s > budget.rto_s:
        if worst is not None:
            phases[worst]["status"] = "over_budget"
        return Verdict(
            False, worst, f"back to full service in {rto_s:.2f} s, over the budget of {budget.rto_s:g} s"
        )
    return Verdict(True, None, None)
