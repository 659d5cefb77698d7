"""Verification beside the watch: each committed checkpoint is verified on a thread of its own, so the
supervisor's poll never waits for a large checkpoint to be re-read.

One worker, in commit order (a newer checkpoint is never proven before an older one finishes);
the caller's context goes with each call (a Prefect task run started from here stays a child of
the supervising task). ``results()`` hands back what finished since the last call; ``join()``
waits for every verification asked for, at the end of a launch.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

Verify = Callable[[int], bool]  # checkpoint id -> proven


@dataclass(frozen=True, slots=True)
class Verified:
    checkpoint_id: int
    step: int | None
    proven: bool


class BesideVerifier:
    def __init__(self, verify: Verify) -> None:
        self._verify = verify
        self._todo: queue.Queue[tuple[int, int | None, contextvars.Context] | None] = queue.Queue()
        self._done: list[Verified] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._work, daemon=True, name="rewind-verify-beside")
        self._thread.start()

    def submit(self, checkpoint_id: int, step: int | None) -> None:
        with self._lock:
            self._pending += 1
        self._todo.put((checkpoint_id, step, contextvars.copy_context()))

    def results(self) -> list[Verified]:
        with self._lock:
            out, self._done = self._done, []
        return out

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def join(self) -> list[Verified]:
        """Every verification asked for, finished (each bounded by its own reads); what finished since
        the last ``results()``."""
        self._todo.put(None)
        self._thread.join()
        return self.results()

    def _work(self) -> None:
        while (item := self._todo.get()) is not None:
            ck_id, step, ctx = item
            try:
                proven = ctx.run(self._verify, ck_id)
            except Exception:  # the verify phase reports its own failures; unproven is all the watch needs
                proven = False
            with self._lock:
                self._done.append(Verified(ck_id, step, proven))
                self._pending -= 1
