"""Memory mappings let go on a thread of their own, off a restore's path.

Unmapping a memory copy's pages costs the kernel page-table work (13 ms per 512 MiB measured here): done
beside the job's next steps instead of before them. A child forked while a drop is pending would inherit
the mapping without the thread that lets it go, and keep a memory copy's pages for its whole life (a data
loader's persistent workers): every fork waits for pending drops first.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

FORK_WAIT_S = 10.0  # a fork waits at most this long for pending drops


def later(drop: Callable[[], None]) -> None:
    """Run ``drop`` (which lets mappings go) on a thread of its own; here where no thread can be started."""
    thread = threading.Thread(target=drop, name="rewind-unmap", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # a process limit on threads, or the interpreter shutting down
        drop()
        return
    _DROPPING[:] = [t for t in _DROPPING if t.is_alive()] + [thread]  # no lock: the fork hook reads it


def dropped(timeout: float = 30.0) -> bool:
    """Wait up to ``timeout`` seconds in all for the drops ``later`` was given; whether they are done. Takes
    no lock: it runs before every fork (``os.register_at_fork``), a signal handler's too."""
    deadline = time.monotonic() + timeout
    waiting = list(_DROPPING)
    for t in waiting:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in waiting)


_DROPPING: list[threading.Thread] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: dropped(timeout=FORK_WAIT_S), after_in_child=_DROPPING.clear)
