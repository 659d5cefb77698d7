"""A polite stop for long waits: the `rewind` CLI's SIGTERM handler asks, and the waits that may be long
(a canary's bake, a server's start-up) end at once by raising ``Stopped``, at a point where their callers
can still clean up (a rollout puts the traffic back). Nothing is interrupted halfway through a catalog
write or a request; the CLI's deadline ends the process if a wait does not come round in time.
"""

from __future__ import annotations

import threading

from rewind.infra.errors import Stopped

_asked = threading.Event()


def request() -> None:
    _asked.set()


def requested() -> bool:
    return _asked.is_set()


def check() -> None:
    if _asked.is_set():
        raise Stopped("stopped by SIGTERM")


def sleep(seconds: float) -> None:
    """``time.sleep``, but ``Stopped`` as soon as a stop is asked for (or was, before)."""
    if _asked.wait(max(0.0, seconds)):
        raise Stopped("stopped by SIGTERM")
