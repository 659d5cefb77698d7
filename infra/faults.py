"""A documented test seam for injecting real faults at named points.

``REWIND_FAULT=<action>:<point>[@<step>]`` with action ``kill`` (SIGKILL this
process) or ``enospc`` (raise a disk-full OSError). Points are named where they
are called, e.g. ``save.data_written``, ``save.before_rename``. Unset in
production; reading one environment variable is the whole cost.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "REWIND_FAULT"


def fault_point(point: str, step: int | None = None) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, _, target = spec.partition(":")
    name, _, at = target.partition("@")
    if name != point or (at and step is not None and int(at) != step):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
