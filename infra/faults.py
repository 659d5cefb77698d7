"""A documented test seam for injecting real faults at named points.

``REWIND_FAULT=<action>:<point>[@<step>][%<rank>][#<times>]`` where action is ``kill``
(SIGKILL this process), ``stop`` (SIGSTOP it: a test holds it at the point, does something
meanwhile and lets it go with SIGCONT), ``hold`` (the calling thread alone waits at the point, the
process goes on: it creates ``$REWIND_FAULT_RELEASE.held`` and waits, at most 10 minutes, until
``$REWIND_FAULT_RELEASE`` exists), ``enospc`` (a disk-full OSError), ``eio`` (an I/O
error, which tasks treat as transient) or ``eacces`` (permission denied, which a
root test process cannot get from chmod). ``#<times>`` fires only on the first N
hits in this process, so a retried task can succeed; ``%<rank>`` fires only in the
process whose ``RANK`` is that (one rank of a job lost). Points are named where they
are called: ``save.file_written``, ``save.before_manifest``, ``save.before_rename``,
``save.before_catalog`` (in a sharded save: rank 0's catalog row, before any rank writes), ``save.shard_written`` (a rank's share of a sharded save),
``ring.pass`` (a peer-ring pass, before any of its collectives; ``hold`` or ``kill`` only: a rank that
skipped a pass would leave the others waiting in it), ``host_agent.pass`` (a host memory agent's pass, the
same; ``@<step>`` the step passed),
``verify.read``, ``group.smoke`` (a launch's process-group smoke test), and ``gc.delete``, whose ``@<N>`` counts deletion steps of this process
(a guarded catalog statement, a file or object removed, a copy's row let go) instead of
steps. With ``REWIND_FAULT_ONCE=<path>`` the fault fires at most once across processes (the
first hit creates that file): a drill's relaunch, which inherits the job's environment, is
then not hurt again. Unset in production; reading one environment variable is
the whole cost.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections import Counter

ENV = "REWIND_FAULT"
ONCE_ENV = "REWIND_FAULT_ONCE"
RELEASE_ENV = "REWIND_FAULT_RELEASE"
HOLD_MAX_S = 600.0
_hits: Counter[str] = Counter()
_hits_lock = threading.Lock()  # a point hit by several threads at once (a checkpoint's files) counts each hit


def fault_point(point: str, step: int | None = None) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, _, target = spec.partition(":")
    target, _, times = target.partition("#")
    target, _, rank = target.partition("%")
    name, _, at = target.partition("@")
    if name != point or (at and step is not None and int(at) != step):
        return
    if rank and os.environ.get("RANK", "0") != rank:
        return
    with _hits_lock:
        _hits[spec] += 1
        hits = _hits[spec]
    if times and hits > int(times):
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return  # fired already, in this process or another
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "hold":
        _hold(point)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
    elif action == "eio":
        raise OSError(errno.EIO, f"Input/output error (injected at {point})")
    elif action == "eacces":
        raise PermissionError(errno.EACCES, f"Permission denied (injected at {point})")


def _hold(point: str) -> None:
    release = os.environ.get(RELEASE_ENV)
    if not release:
        raise RuntimeError(
            f"REWIND_FAULT=hold:{point} needs {RELEASE_ENV}=<path> (the file that ends the hold)"
        )
    with open(f"{release}.held", "a"):
        pass
    deadline = time.monotonic() + HOLD_MAX_S
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
