"""One background job at a time, at a stated CPU priority, with errors that surface at the next call.

A second ``submit`` waits for the first (back-pressure) instead of stacking
copies of the state. A failure is logged when it happens and raised from the
next ``submit``, ``wait`` or ``close``, so training never goes on believing a
checkpoint exists that does not.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rewind.infra.checkpoint.priority import PersistPriority, apply_to_this_thread
from rewind.infra.errors import RewindError

log = logging.getLogger("rewind.checkpoint")


class BackgroundSaveError(RewindError):
    """The previous background save failed; its checkpoint was not committed."""


class BackgroundRunner:
    def __init__(
        self, name: str, exit_timeout_s: float = 300.0, *, priority: PersistPriority = PersistPriority.NORMAL
    ) -> None:
        self.name = name
        self.exit_timeout_s = exit_timeout_s
        self.priority = priority
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""
        atexit.register(self._at_exit)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def idle(self) -> bool:
        """No job in flight and no failure waiting to be raised: a job submitted now starts at once."""
        return not self.busy and self._error is None

    def submit(self, what: str, fn: Callable[[], Any]) -> float:
        """Start ``fn`` in the background; returns seconds spent waiting for the previous job."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0

        def body() -> None:
            try:
                apply_to_this_thread(self.priority)
                fn()
            except BaseException as exc:  # handed to the caller at the next call
                log.error("background %s failed: %s", what, exc)
                self._error = exc

        self._what = what
        self._thread = threading.Thread(target=body, name=f"{self.name}-{what}", daemon=True)
        self._thread.start()
        return waited

    def wait(self, timeout: float | None = None) -> None:
        """Block until the in-flight job ends; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"background {self._what} still running after {timeout}s")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise BackgroundSaveError(f"background {self._what} failed: {err}") from err

    def close(self, timeout: float | None = None) -> None:
        atexit.unregister(self._at_exit)
        self.wait(timeout)

    def _at_exit(self) -> None:
        if self.busy:
            log.warning(
                "waiting up to %.0fs for the in-flight %s before exit", self.exit_timeout_s, self._what
            )
            try:
                self.wait(self.exit_timeout_s)
            except (TimeoutError, BackgroundSaveError) as exc:
                log.error("%s", exc)
