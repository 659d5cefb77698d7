"""The CPU priority of a background persist: ``REWIND_PERSIST_PRIORITY=normal|low|idle``.

A background save writes, hashes and fsyncs while the job trains; on a machine whose cores the job
keeps busy, every cycle it takes is a cycle the job loses. ``normal`` (the default) persists at the
job's own priority; ``low`` is nice 19 (a small share, never starved); ``idle`` runs the persisting
thread under Linux's ``SCHED_IDLE``: only on cycles nothing else wants, so the job keeps its cores
and the persist fills the gaps (data loading, collectives, waits on a GPU). The price is commit
latency on a machine kept fully busy, i.e. a larger RPO: measured with a 51M-parameter job on both
of 2 cores, ``idle`` once cut the training overhead from +4.9% to +3.5% but committed 18.75 s after
``save()`` instead of 1.56 s (at the latest the next save waits for it); in every later run, on two
machines, it cost more than ``normal`` in the same run (``idle`` +4.4% to +12.9%): the persist it held
back is then waited for whole, while at ``normal`` its writes and syncs overlap the job. Hence not the
default.
Threads the persist starts inherit it. Where the platform has neither, the priority is left as is.
"""

from __future__ import annotations

import logging
import os
import threading
from enum import StrEnum

from rewind.infra.errors import ConfigError

ENV = "REWIND_PERSIST_PRIORITY"
LOWEST_NICE = 19

log = logging.getLogger("rewind.checkpoint")


class PersistPriority(StrEnum):
    IDLE = "idle"
    LOW = "low"
    NORMAL = "normal"


def configured() -> PersistPriority:
    """The priority ``REWIND_PERSIST_PRIORITY`` asks for (default ``normal``); a bad value is a ``ConfigError``."""
    raw = os.environ.get(ENV, "").strip().lower() or PersistPriority.NORMAL.value
    try:
        return PersistPriority(raw)
    except ValueError:
        choices = ", ".join(p.value for p in PersistPriority)
        raise ConfigError(f"{ENV}={raw!r}: expected one of {choices}") from None


def apply_to_this_thread(priority: PersistPriority) -> None:
    """Lower the calling thread (only it: Linux schedules threads on their own) to ``priority``."""
    if priority is PersistPriority.NORMAL:
        return
    tid = threading.get_native_id()
    try:
        if priority is PersistPriority.IDLE and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST_NICE)
    except OSError as exc:  # a sandbox that forbids it: persist at the job's priority
        log.debug("persist priority %s not applied: %s", priority.value, exc)
