"""A run's one-writer lease as a process holds it: taken at start, renewed at each save and, between saves,
by a thread of its own, let go at the end.

A holder silent for ``leases.WRITER_TTL_S`` is presumed gone wherever its host and launch cannot say
(another host, a job no supervisor started). Renewed at saves alone, a job saving less often than that
(hours apart, as large models do) would be presumed gone while it trains: a second job of the run let
in, a roll-back made under it. The renewal thread must never fail the job: a catalog that cannot be
reached is a warning, and the next try comes at the next beat. It renews for at most ``SILENT_MAX_S``
after the last save (or the take): a process that failed without letting go (a notebook whose training
raised) does not hold the run for as long as it lives.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from rewind.infra.catalog import leases
from rewind.infra.catalog.db import Catalog

log = logging.getLogger("rewind.catalog")
SILENT_MAX_S = 24 * 3600.0  # renewed between saves for at most this long after the last one


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
        self._saved_at = time.monotonic()

    def take(self) -> None:
        leases.take_writer(self.cat, self.run_id, self.who)
        self._saved_at = time.monotonic()
        if self._thread is None and not self.cat.in_memory:  # another thread's in-memory catalog is empty
            self._stop = threading.Event()
            self._thread = threading.Thread(  # holding the lease weakly: one nobody holds stops renewing
                target=_beat,
                args=(weakref.ref(self), self._stop, beat_s()),
                name="rewind-writer-lease",
                daemon=True,
            )
            self._thread.start()

    def touch(self) -> None:
        """Still here (a committed save says so). Never raises: the save is committed whatever happens here,
        and the renewal beat says the same a moment later."""
        self._saved_at = time.monotonic()
        try:
            leases.touch_writer(self.cat, self.run_id, self.who)
        except Exception as exc:
            log.warning("the writer lease of run %d was not renewed after a save: %s", self.run_id, exc)

    def release(self) -> None:
        """Stop renewing, then let another process write the run."""
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._stop = self._thread = None
        leases.release_writer(self.cat, self.run_id, self.who)

    def renew(self) -> bool:
        """Renew between saves; False once a day has passed since the last save (the renewal stops)."""
        if time.monotonic() - self._saved_at > SILENT_MAX_S:
            log.warning("run %d: no save for %.0f h: its writer lease is no longer renewed",
                        self.run_id, SILENT_MAX_S / 3600)  # fmt: skip
            return False
        try:
            leases.touch_writer(self.cat, self.run_id, self.who)
        except Exception as exc:  # the job goes on; the next beat tries again
            log.warning("the writer lease of run %d was not renewed: %s", self.run_id, exc)
        return True


def _beat(lease: weakref.ref[WriterLease], stop: threading.Event, every_s: float) -> None:
    """Renew ``lease`` every ``every_s`` until stopped, given up, or no longer held by anyone: the thread
    keeps no lease (nor its catalog's connections) alive."""
    while not stop.wait(every_s):
        held = lease()
        if held is None or not held.renew():
            return
        del held
