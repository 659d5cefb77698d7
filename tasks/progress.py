"""Byte progress inside flows: each phase of long work (``rewind.infra.progress``) as a Prefect progress artifact.

The artifact is created when a phase starts and updated at each whole percent, so a
100 GB replication shows in the UI as it goes, not only when it ends. Showing progress
must never fail the work it shows: an API error is logged once and the meter goes quiet.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from rewind.infra import progress
from rewind.infra.training.progress import RankState

log = logging.getLogger("rewind.progress")


MIN_BYTES = 256 << 20  # smaller work is over before a bar would help; no artifact for it
QUIET_S = 30.0  # after an API error, updates wait this long before trying again


class ArtifactMeter:
    """One progress artifact per phase of at least ``min_bytes``; thread-safe (S3 part threads report too).

    The API is called outside the meter's lock and by one thread at a time (the others go on with
    their bytes; the next percent carries the news), so a slow Prefect API never holds up a transfer.
    """

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        self._min = min_bytes
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._id: UUID | None = None
        self._what, self._total, self._done, self._shown = "", 0, 0, 0
        self._quiet_until = 0.0

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if time.monotonic() < self._quiet_until:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # the UI's view is late, the work is not: try again in a while
            self._quiet_until = time.monotonic() + QUIET_S
            log.warning("progress artifact not updated (%s); the work goes on", exc)
            return None

    def begin(self, what: str, total: int) -> None:
        with self._lock:
            self._what, self._total, self._done, self._shown, self._id = what, total, 0, 0, None
        if total >= self._min:
            made = self._call(create_progress_artifact, 0.0, description=what)
            with self._lock:
                self._id = made

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            pct = min(100, 100 * self._done // self._total) if self._total else 0
            if pct <= self._shown or self._id is None:
                return
            self._shown = pct
        if self._sending.acquire(
            blocking=False
        ):  # another thread is sending: it or the next percent will say
            try:
                with self._lock:
                    target, newest = self._id, self._shown
                if target is not None:
                    self._call(update_progress_artifact, target, float(newest))
            finally:
                self._sending.release()

    def set(self, what: str, pct: float) -> None:
        """Show ``what`` at ``pct`` percent, outside any byte phase (one artifact, kept up to date)."""
        if self._id is None:
            self._id = self._call(create_progress_artifact, pct, description=what)
        else:
            self._call(update_progress_artifact, self._id, pct, description=what)

    def end(self) -> None:
        with self._lock:
            target, self._id = self._id, None
            gib = self._done / (1 << 30)
            pct = 100.0 if self._done >= self._total else 100 * self._done / max(1, self._total)
        if target is not None:
            with self._sending:
                self._call(update_progress_artifact, target, pct, description=f"{self._what}: {gib:.2f} GiB")


@contextlib.contextmanager
def shown() -> Iterator[None]:
    """Report the long work inside the block as progress artifacts of the current task run."""
    with progress.watching(ArtifactMeter()):
        yield


class TrainingView:
    """protect-training's progress artifact: the step out of the job's total, the loss, the newest verified step.

    Updated when any of the three changes (at most once per supervisor poll).
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self._meter = ArtifactMeter(min_bytes=0)
        self._shown: tuple[int, int | None] | None = None

    def show(self, ranks: list[RankState], verified_step: int | None) -> None:
        steps = [r.step for r in ranks if r.step is not None]
        if not steps:
            return
        step = min(steps)  # the job is as far as its slowest rank
        if (step, verified_step) == self._shown:
            return
        self._shown = (step, verified_step)
        total = max((int(r.detail.get("total_steps") or 0) for r in ranks), default=0)
        loss = next((r.loss for r in sorted(ranks, key=lambda r: r.rank) if r.loss is not None), None)
        what = (
            f"{self.run}: step {step}" + (f" of {total}" if total else "")
            + (f", loss {loss:.4g}" if loss is not None else "")
            + f", newest verified checkpoint: {'none yet' if verified_step is None else f'step {verified_step}'}"
        )  # fmt: skip
        pct = min(100.0, 100 * step / total) if total else 0.0
        self._meter.set(what, pct)
