"""A run's one-writer lease as a process holds it: taken at start, renewed at each save and, between saves,
by a thread of its own, let go at the end.

A holder silent for ``leases.WRITER_TTL_S`` is presumed gone wherever its host and launch cannot say
(another host, a job no supervisor started). Renewed at saves alone, a job saving less often than that
(hours apart, as large models do) would be presumed gone while it trains: a second job of the run let
in, a roll-back made under it. The renewal thread must never fail the job: a catalog that cannot be
reached is a warning, and the next try comes at the next beat.
"""

from __future__ import annotations

import logging
import threading

from rewind.infra.catalog import leases
from rewind.infra.catalog.db import Catalog

log = logging.getLogger("rewind.catalog")


def beat_s() -> float:
    """How often the lease is renewed between saves: well inside its time to live."""
    return leases.WRITER_TTL_S / 6


class WriterLease:
    """This process as the run's one writer, from ``take`` (``RunBusy`` naming the live one) to ``release``."""

    def __init__(self, cat: Catalog, run_id: int) -> None:
        self.cat, self.run_id = cat, run_id
        self.who = leases.writer_name()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def take(self) -> None:
        leases.take_writer(self.cat, self.run_id, self.who)
        if self._thread is None:
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._beat, args=(self._stop, beat_s()), name="rewind-writer-lease", daemon=True
            )
            self._thread.start()

    def touch(self) -> None:
        """Still here (a committed save says so)."""
        leases.touch_writer(self.cat, self.run_id, self.who)

    def release(self) -> None:
        """Stop renewing, then let another process write the run."""
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._stop = self._thread = None
        leases.release_writer(self.cat, self.run_id, self.who)

    def _beat(self, stop: threading.Event, every_s: float) -> None:
        while not stop.wait(every_s):
            try:
                self.touch()
            except Exception as exc:  # the job goes on; the next beat tries again
                log.warning("the writer lease of run %d was not renewed: %s", self.run_id, exc)
