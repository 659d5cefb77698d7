"""What the supervisor makes of what it sees: typed observations, and the judgement of ranks' progress.

Pure functions over the ranks' progress rows, so the rules are testable alone:

- a rank that is stepping is hung when its step has not advanced for the hang timeout;
- a rank that said it is busy (restoring, starting up, saving a checkpoint) is given
  the longer busy timeout instead, so a slow first step or a long save is not a hang;
- a rank that stopped writing at all (a stopped or wedged process: its own reporting
  thread is silent too) is hung after the hang timeout, whatever it said before;
- a launch whose ranks have not all reported within the busy timeout is hung too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rewind.infra.catalog import models
from rewind.infra.training.progress import RankState


class Seen(StrEnum):
    FIRST_STEP = "first_step"  # a rank got past the step it started from
    COMMITTED = "committed"  # a checkpoint was committed
    ANOMALY = "anomaly"  # a rank recorded NaN/Inf or a loss spike
    HANG = "hang"  # a rank made no progress for longer than it may
    GPU = "gpu"  # NVML says a GPU is unhealthy
    EXITED = "exited"  # a process (or a node's agent) ended
    HOST_LOST = "host_lost"  # the scheduler says a host of the launch is gone (not responding, down)


@dataclass(frozen=True, slots=True)
class Observation:
    kind: Seen
    at: float
    step: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Limits:
    hang_s: float | None  # None: hangs are not watched
    busy_s: float  # what a busy phase (restore, start-up, a save) may take
    world_size: int
    started_at: float


def first_step(ranks: list[RankState]) -> Observation | None:
    """The first step past the restore point, timed by the rank that made it."""
    moved = [r for r in ranks if r.step is not None and r.step > int(r.detail.get("start_step", r.step))]
    if not moved:
        return None
    first = min(moved, key=lambda r: r.step_at or r.beat_at)
    start = min(int(r.detail.get("start_step", 0)) for r in ranks)
    lead = min(ranks, key=lambda r: r.rank)  # rank 0 knows which checkpoint it loaded
    ready = [float(t) for r in ranks if (t := r.detail.get("group_ready_at")) is not None]
    detail = {
        "from_step": start,
        "restored": lead.detail.get("restored"),
        # every rank's group passed its smoke test: the launch's topology is rebuilt
        "group_ready_at": max(ready) if ready and len(ready) == len(ranks) else None,
        "loss": first.loss,  # the comeback's first loss, beside the restore point's (the incident keeps both)
    }
    return Observation(Seen.FIRST_STEP, first.step_at or first.beat_at, first.step, detail)


def anomaly(ranks: list[RankState]) -> Observation | None:
    """The earliest anomaly any rank recorded: later ones on other ranks are its consequences."""
    found = sorted((r for r in ranks if "anomaly" in r.detail), key=lambda r: r.detail["anomaly"]["step"])
    if not found:
        return None
    a = found[0].detail["anomaly"]
    return Observation(Seen.ANOMALY, found[0].beat_at, a.get("step"), {**a, "rank": found[0].rank})


def _hung(r: RankState, now: float, lim: Limits) -> tuple[str, float] | None:
    """Why this rank is hung, and for how long it has been silent; None if it is not."""
    assert lim.hang_s is not None
    if r.state not in models.LIVE_RANK_STATES:
        return None
    if now - r.beat_at > lim.hang_s:
        return f"rank {r.rank} on {r.node} stopped reporting {_after(r.step)}", now - r.beat_at
    busy = r.state == models.RankState.BUSY
    allowed = lim.busy_s if busy else lim.hang_s
    if r.silent_for(now) > allowed:
        what = f"busy ({r.detail.get('busy', '?')})" if busy else "made no progress"
        return f"rank {r.rank} on {r.node} {what} {_after(r.step)} (limit {allowed:g}s)", r.silent_for(now)
    return None


def _after(step: int | None) -> str:
    return "before its first step" if step is None else f"after step {step}"


def hang(ranks: list[RankState], now: float, lim: Limits) -> Observation | None:
    if lim.hang_s is None:
        return None
    found = [(r, h) for r in ranks if (h := _hung(r, now, lim)) is not None]
    if not found and len(ranks) < lim.world_size and now - lim.started_at > lim.busy_s:
        why = f"{lim.world_size - len(ranks)} of {lim.world_size} ranks never reported"
        return Observation(
            Seen.HANG, now, None, {"ranks": [], "silent_s": now - lim.started_at, "reason": why}
        )
    if not found:
        return None
    detail = {
        "ranks": [r.rank for r, _ in found],
        "silent_s": max(silent for _, (_, silent) in found),
        "timeout_s": lim.hang_s,
        "reason": "; ".join(f"{why}: silent {silent:.1f}s" for _, (why, silent) in found),
    }
    return Observation(Seen.HANG, now, min((r.step or 0) for r, _ in found), detail)


def first_failure(observations: list[Observation]) -> Observation | None:
    """The exit that ended the launch, else None.

    A process killed by a signal is the cause rather than the consequence (the others
    fail because their peers vanished); among equals, the one that ended first.
    """
    failed = [o for o in observations if o.kind is Seen.EXITED and o.detail["exit_code"] != 0]
    return min(failed, key=lambda o: (o.detail["exit_code"] > 0, o.at)) if failed else None
