"""Which signal told of a failure first: a node's exit, the scheduler, or a rank's silent heartbeat.

A lost host shows up in several places at different times: its peers' collectives fail within about a
second and their agents exit (gloo, NCCL), the scheduler marks the host not responding after its node
timeout (Slurm's ``SlurmdTimeout``), and the ranks' heartbeats stop, which the supervisor calls a hang after
the spec's timeout. A partitioned host may show no exit at all (collectives hang). Rewind acts on whichever
comes first; this records when each came, in seconds after the failed part's last progress (its last step,
or heartbeat before its first: a cut-off host's ranks may go on beating while their collectives hang), so
that the detection time of each signal is measured on every incident, not assumed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rewind.infra.training.progress import RankState


@dataclass(frozen=True, slots=True)
class Detection:
    """When each signal was seen (epoch seconds; None: never), and the failed part's last progress."""

    last_progress_at: float | None
    exit_at: float | None = None  # the first node that exited with a failure
    scheduler_at: float | None = None  # the scheduler called a host lost
    heartbeat_at: float | None = None  # a rank's silence passed the hang timeout

    def as_dict(self) -> dict[str, Any]:
        seen = {"exit": self.exit_at, "scheduler": self.scheduler_at, "heartbeat": self.heartbeat_at}
        after = {k: _after(v, self.last_progress_at) for k, v in seen.items()}
        first = min((k for k, v in seen.items() if v is not None), key=lambda k: seen[k] or 0.0, default=None)
        return {
            "seconds_after_last_progress": after,
            "first": first,
            "last_progress_at": self.last_progress_at,
        }


def _after(at: float | None, since: float | None) -> float | None:
    return None if at is None or since is None else round(max(0.0, at - since), 3)


def last_progress(ranks: Iterable[RankState], lost: Mapping[str, int] | None = None) -> float | None:
    """The failed part's last progress: the newest of the ranks on the lost hosts (``lost``: host -> node
    index; a rank is on a node by the index its supervisor gave it, else by its host name); with no host
    lost, the oldest of every rank's newest (the first rank to stop). Before its first step: its heartbeat."""
    rows, lost = list(ranks), dict(lost or {})
    at = [(r.step_at if r.step_at is not None else r.beat_at, r.node) for r in rows]
    if lost:
        nodes = {str(i) for i in lost.values()}
        return max((t for t, node in at if _on(node, set(lost), nodes)), default=None)
    return min((t for t, _ in at), default=None)


def _on(node: str, hosts: set[str], indices: set[str]) -> bool:
    host, _, index = node.partition("/")
    return index in indices if index else host in hosts
