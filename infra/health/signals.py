"""Failure signals from a running job: hung or crashed ranks, and numerical trouble.

Pure logic over observations (heartbeats, exit codes, losses), so a supervisor
can feed it from files, pipes or a store, and tests can feed it directly.
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


@dataclass
class Heartbeats:
    """Last heartbeat (time, step) per rank; a rank silent longer than ``timeout_s`` is hung."""

    timeout_s: float
    last: dict[int, tuple[float, int]] = field(default_factory=dict)

    def beat(self, rank: int, step: int, now: float) -> None:
        self.last[rank] = (now, step)

    def hung(self, now: float) -> list[Detection]:
        return [
            Detection(
                "hang",
                rank,
                step,
                f"rank {rank} silent for {now - t:.1f}s (timeout {self.timeout_s:g}s) at step {step}",
            )
            for rank, (t, step) in sorted(self.last.items())
            if now - t > self.timeout_s
        ]


def describe_exit(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def exit_detection(rank: int, code: int, step: int | None) -> Detection | None:
    """A non-zero exit or a signal is a crash; 0 is not."""
    if code == 0:
        return None
    return Detection("crash", rank, step, f"rank {rank} {describe_exit(code)}")


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
