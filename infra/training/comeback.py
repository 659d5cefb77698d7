"""The comeback watched: after a restore, each step's loss against the same step's loss before the failure.

The failed launch's rank 0 kept its last ``KEPT`` losses with its progress; the recovery hands the ones
past the restore point to the relaunch (``comeback`` in the handoff). The same data at the same step
numbers gives the same losses on a bit-exact resume; after a layout change (another world size, a
rescaled rate: rank 0 sees other samples) they differ step by step. Each step that has a loss from before
is compared: the largest deviation (absolute, and relative to the loss before) is kept, with how many
steps were identical bit for bit. On the same layout ``IN_A_ROW`` steps in a row whose relative
deviation passes ``TOLERANCE`` (and is more than ``FLOOR``) are a divergence. On another layout rank 0's
loss is over other samples, and with a small batch its mean can sit well off the run's before (half of it
or twice it) on a sound restore: only a blow-up is a divergence there, the mean loss over the steps
compared (at least ``RESHAPED_MIN_STEPS``) ``RESHAPED_FACTOR`` times the mean before or more (what a lost
optimizer state or a wrong shard does to a run); smaller deviations are recorded, never acted on. A divergence is an anomaly of
the job (the restore point or the new layout is not what the run was), told without a data position:
the recovery rolls back, and skips no data. Only a job whose loader replays the same samples at the same
steps is compared (a loader with a global position, restored: ``ResumableLoader``); any other's
batches after a restore are not the ones before. The comparison covers the first ``WINDOW`` steps
after the restore at most.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

KEPT = 100  # losses of the newest steps a rank 0 keeps with its progress
WINDOW = 100  # steps after a restore compared with the same steps before the failure
TOLERANCE = 0.05  # same layout: relative deviation of a step's loss beyond which the comeback diverged
IN_A_ROW = 3  # ... on this many steps in a row (one odd step is noise, e.g. a nondeterministic kernel)
FLOOR = 1e-6  # deviations this small are never a divergence, however small the loss
KIND = "loss_spike"  # the anomaly kind a divergence is told as (the recovery rolls it back, skipping no data)
RESHAPED_FACTOR = 4.0  # another layout: the mean loss over the steps compared this many times the mean before
RESHAPED_MIN_STEPS = 10  # ... judged once this many steps were compared (one step's batch differs anyway)


class RecentLosses:
    """The newest ``KEPT`` steps' finite losses, as reported (a step reported again replaces its loss).

    NaN and Inf are left out: nothing is compared with them, and JSON in Postgres has no spelling for them
    (a progress row carrying one would be refused, and with it the anomaly it tells).
    """

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._losses: OrderedDict[int, float] = OrderedDict()

    def add(self, step: int, loss: float) -> None:
        self._losses.pop(step, None)
        if not math.isfinite(loss):
            return
        self._losses[step] = loss
        while len(self._losses) > self.kept:
            self._losses.popitem(last=False)

    def as_dict(self) -> dict[str, float]:
        return {str(k): v for k, v in self._losses.items()}


def before_failure(recorded: Any, restored_step: int) -> dict[int, float]:
    """The losses a failed launch recorded past the restore point (what the relaunch replays)."""
    if not isinstance(recorded, dict):
        return {}
    out: dict[int, float] = {}
    for k, v in recorded.items():
        try:
            step, loss = int(k), float(v)
        except (TypeError, ValueError):
            continue
        if restored_step < step <= restored_step + WINDOW and math.isfinite(loss):
            out[step] = loss
    return out


@dataclass
class Comeback:
    """The comparison as the relaunch goes: fed each step's loss, it says when the comeback diverged."""

    before: dict[int, float]
    tolerance: float = TOLERANCE
    same_layout: bool = True
    compared: int = 0
    sum_after: float = 0.0
    sum_before: float = 0.0
    identical: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst_step: int | None = None
    diverged_at: int | None = field(default=None)
    off: int = 0  # steps in a row beyond the tolerance

    def observe(self, step: int, loss: float) -> str | None:
        """Compare one step; the reason, when it diverged beyond the tolerance (once)."""
        was = self.before.get(step)
        if was is None or self.diverged_at is not None:
            return None
        self.compared += 1
        self.identical += loss == was
        self.sum_after, self.sum_before = self.sum_after + loss, self.sum_before + was
        dev = abs(loss - was)
        rel = _rel(loss, was)
        if rel > self.max_rel or self.worst_step is None:
            self.max_abs, self.max_rel, self.worst_step = dev, rel, step
        self.off = self.off + 1 if rel > self.tolerance and dev > FLOOR else 0
        if self.same_layout and self.off >= IN_A_ROW:
            self.diverged_at = step
            return (
                f"the comeback diverged at step {step}: loss {loss:.6g} against {was:.6g} at the same step before "
                f"the failure ({rel:.1%} off; {self.off} steps in a row past the tolerance {self.tolerance:.1%})"
            )
        if not self.same_layout and self.compared >= RESHAPED_MIN_STEPS and self._blown_up():
            self.diverged_at = step
            return (
                f"the comeback diverged by step {step} on its new layout: mean loss over {self.compared} steps "
                f"{self.sum_after / self.compared:.6g} against {self.sum_before / self.compared:.6g} over the same "
                f"steps before the failure ({RESHAPED_FACTOR:g} times or more is a divergence)"
            )
        return None

    def _blown_up(self) -> bool:
        if not math.isfinite(self.sum_after):
            return True
        if self.sum_before <= 0:  # a loss that goes negative (a log-likelihood) has no factor to judge by
            return False
        return (
            self.sum_after >= RESHAPED_FACTOR * self.sum_before and self.sum_after - self.sum_before > FLOOR
        )

    @property
    def done(self) -> bool:
        return self.diverged_at is not None or self.compared >= len(self.before)

    def as_dict(self) -> dict[str, Any]:
        return {
            "same_layout": self.same_layout, "mean_rel_deviation": _rel(self.sum_after, self.sum_before),
            "compared": self.compared, "identical": self.identical, "max_abs_deviation": self.max_abs,
            "max_rel_deviation": self.max_rel, "worst_step": self.worst_step, "tolerance": self.tolerance,
            "diverged_at": self.diverged_at,
        }  # fmt: skip


def _rel(now: float, was: float) -> float:
    return abs(now - was) / max(abs(was), 1e-12) if math.isfinite(now) else math.inf


class Notes(Protocol):
    def note(self, **detail: Any) -> None: ...


def check(watch: Comeback | None, step: int, loss: float, notes: Notes | None) -> str | None:
    """One step of the comeback: why it diverged, if it did; the comparison told (``notes``) once done."""
    if watch is None or watch.done:
        return None
    why = watch.observe(step, loss)
    if watch.done and notes is not None:
        notes.note(comeback=watch.as_dict())
    return why


def tell_unfinished(watch: Comeback | None, notes: Notes | None) -> None:
    """The job ended before every step was compared: what was, told all the same."""
    if watch is not None and notes is not None and watch.compared and not watch.done:
        notes.note(comeback=watch.as_dict())
