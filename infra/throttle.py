"""An optional write-bandwidth limit for a job: ``REWIND_WRITE_LIMIT=200MiB`` (bytes per second).

Checkpoint bursts from many jobs at once can starve a shared filesystem for everyone
on it; a job given a limit paces its file writes (checkpoint saves, fetches into the
local tier, copies to a shared tier) to it on average, with bursts of up to a second's
worth. One bucket per process, shared by every thread that writes: the background
save, replication and restores together stay under the limit. Unset (the default),
writes are not paced at all.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from rewind.infra import sizes
from rewind.infra.errors import ConfigError

ENV = "REWIND_WRITE_LIMIT"
MIN_RATE = 1 << 20  # below 1 MiB/s a checkpoint would take days: surely a typo (e.g. "200" for 200MiB)


class Throttle:
    """A token bucket: on average ``rate`` bytes per second, up to ``rate`` bytes at once.

    A write larger than what is in the bucket goes ahead and leaves a debt that the
    writer (and whoever writes next) sleeps off, so concurrent writers share the rate.
    """

    def __init__(
        self,
        rate: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError("a write limit must be a positive number of bytes per second")
        self.rate = rate
        self.slice = max(4096, min(1 << 20, int(rate) // 8))  # the most one write charges at once
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = rate
        self._last = clock()

    def take(self, n: int) -> None:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)


_current: tuple[str, Throttle | None] = ("", None)
_lock = threading.Lock()


def for_writes() -> Throttle | None:
    """This process's write limit from ``REWIND_WRITE_LIMIT`` (None when unset); a bad value is a ConfigError."""
    global _current
    text = os.environ.get(ENV, "").strip()
    with _lock:
        if _current[0] != text:
            rate = sizes.parse(text, what=ENV) if text else 0
            if text and rate < MIN_RATE:
                raise ConfigError(f"{ENV}: {text!r} is under the least limit, 1MiB (bytes per second)")
            _current = (text, Throttle(rate) if rate else None)
        return _current[1]
