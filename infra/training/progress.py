"""The channel between a training rank and its supervisor: one progress row per rank, in the catalog.

Both sides import this module. A rank's ``ProgressWriter`` keeps the latest
step (and loss, samples) in memory, which the training loop updates for free,
and a background thread writes it every ``interval_s``; an anomaly or the end
of the job is written at once. The supervisor's ``read`` turns a launch's rows
into ``RankState``s: a rank whose step has not advanced for longer than the
hang timeout is hung, whether its process is stuck in a collective or stopped.

Times are the writer's clock (epoch seconds): nodes are expected to keep NTP time.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from rewind.infra.catalog import jobs, models
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import TransientError
from rewind.infra.training import comeback

log = logging.getLogger("rewind.progress")
LAUNCH_ENV = "REWIND_LAUNCH_ID"
# Launch ids restart at 1 in every catalog: processes are told apart by this token, unique per launch.
TOKEN_ENV = "REWIND_LAUNCH_TOKEN"
NODE_ENV = "REWIND_NODE"


@dataclass(frozen=True, slots=True)
class RankState:
    rank: int
    node: str
    pid: int
    step: int | None
    loss: float | None
    step_at: float | None
    beat_at: float
    state: models.RankState
    detail: dict[str, Any]

    def silent_for(self, now: float) -> float:
        """Seconds since this rank last made progress (or first reported, before its first step)."""
        return now - (self.step_at if self.step_at is not None else self.beat_at)


def node_name() -> str:
    """This process's node: the host, and the simulated node index when several share one host."""
    host = socket.gethostname()
    return f"{host}/{os.environ[NODE_ENV]}" if os.environ.get(NODE_ENV) else host


class ProgressWriter:
    """A rank's side of the channel; ``report`` is cheap (memory), a thread does the writing."""

    def __init__(
        self, cat: Catalog, launch_id: int, rank: int, *, interval_s: float = 1.0, keep_losses: bool = False
    ) -> None:
        self.cat, self.launch_id, self.rank, self.interval_s = cat, launch_id, rank, interval_s
        # the newest steps' losses, kept with the progress (rank 0): what a relaunch's comeback is held to
        self._losses = comeback.RecentLosses() if keep_losses else None
        self._fields: dict[str, Any] = {
            "node": node_name(),
            "pid": os.getpid(),
            "state": models.RankState.RUNNING,
            "detail": {},
        }
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rewind-progress-{rank}", daemon=True)

    def start(self, busy: str) -> None:
        """First row (busy with ``busy``), then a beat every ``interval_s`` from the thread."""
        self._fields.update(state=models.RankState.BUSY, detail={"busy": busy}, step_at=time.time())
        self._write()
        self._thread.start()

    def report(self, step: int | None, loss: float | None, samples: int | None) -> None:
        with self._lock:
            if step != self._fields.get("step"):
                self._fields["step_at"] = time.time()
            self._fields.update(step=step, loss=loss, samples=samples)
            if self._losses is not None and step is not None and loss is not None:
                self._losses.add(step, loss)

    def busy(self, what: str | None) -> None:
        """Enter a phase that may outlast a step (``"restoring"``, ``"starting"``, ``"saving"``), or leave it.

        The supervisor allows a busy rank its longer busy timeout; the silence is
        counted from the change either way, and its thread's beats keep it alive.
        """
        with self._lock:
            detail = {k: v for k, v in self._fields["detail"].items() if k != "busy"}
            if what is not None:
                detail["busy"] = what
            if self._fields["state"] in models.LIVE_RANK_STATES:
                self._fields["state"] = (
                    models.RankState.BUSY if what is not None else models.RankState.RUNNING
                )
            self._fields.update(detail=detail, step_at=time.time())
        self._write()

    def note(self, **detail: Any) -> None:
        """Add facts for the supervisor (what the job applied, an anomaly) and write them now."""
        with self._lock:
            self._fields["detail"] = {**self._fields["detail"], **detail}
            if "anomaly" in detail:
                self._fields["state"] = models.RankState.ANOMALY
        self._write()

    def finish(self, state: models.RankState = models.RankState.FINISHED) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            if self._fields["state"] in models.LIVE_RANK_STATES:
                self._fields["state"] = state
        self._write()

    def _write(self) -> None:
        with self._lock:
            fields = {**self._fields, "beat_at": time.time()}
            if self._losses is not None:
                fields["detail"] = {**fields["detail"], "losses": self._losses.as_dict()}
        try:
            jobs.report(self.cat, self.launch_id, self.rank, **fields)
        except TransientError as exc:  # the catalog blinked: the next beat tries again
            log.warning("progress of rank %d not written: %s", self.rank, exc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()


def read(cat: Catalog, launch_id: int) -> list[RankState]:
    """Every rank's last report for a launch (the supervisor's side)."""
    return [
        RankState(r.rank, r.node, r.pid, r.step, r.loss, r.step_at, r.beat_at, r.state, dict(r.detail or {}))
        for r in jobs.progress(cat, launch_id)
    ]
