"""Failure signals from a running job: how a process ended, and numerical trouble in its loss.

Pure logic over observations, so the training session and the supervisor can
feed it what they see, and tests can feed it directly.
"""

from __future__ import annotations

import math
import signal
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Detection:
    kind: str  # crash | hang | nan | loss_spike
    rank: int | None
    step: int | None
    reason: str


def describe_exit(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


SEEDED_MIN = 3  # losses from before a restore that are enough to judge a spike by


@dataclass
class LossWatch:
    """NaN/Inf losses, and spikes above ``spike_factor`` times the running median of the last ``window``."""

    spike_factor: float = 3.0
    window: int = 50
    min_history: int = 10
    _history: deque[float] = field(default_factory=deque)

    def observe(self, step: int, loss: float) -> Detection | None:
        if not math.isfinite(loss):
            return Detection("nan", None, step, f"loss is {loss} at step {step}")
        if len(self._history) >= self.min_history:
            median = statistics.median(self._history)
            if median > 0 and loss > self.spike_factor * median:
                return Detection(
                    "loss_spike",
                    None,
                    step,
                    f"loss {loss:.4g} at step {step} is {loss / median:.1f}x the running median {median:.4g}",
                )
        self._history.append(loss)
        if len(self._history) > self.window:
            self._history.popleft()
        return None

    def seed(self, losses: list[float]) -> None:
        """Start from losses seen before (the restored run's, at its checkpoints): a spike right after a
        restore is judged against them instead of going unseen while the history fills again."""
        kept = [x for x in losses if math.isfinite(x)][-self.window :]
        self._history = deque(kept)
        if len(kept) >= SEEDED_MIN:
            self.min_history = min(self.min_history, len(kept))
