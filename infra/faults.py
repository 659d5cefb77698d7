"""A documented test seam for injecting real faults at named points.

``REWIND_FAULT=<action>:<point>[@<step>][%<rank>][#<times>]`` where action is ``kill``
(SIGKILL this process), ``stop`` (SIGSTOP it: a test holds it at the point, does something
meanwhile and lets it go with SIGCONT), ``enospc`` (a disk-full OSError), ``eio`` (an I/O
error, which tasks treat as transient) or ``eacces`` (permission denied, which a
root test process cannot get from chmod). ``#<times>`` fires only on the first N
hits in this process, so a retried task can succeed; ``%<rank>`` fires only in the
process whose ``RANK`` is that (one rank of a job lost). Points are named where they
are called: ``save.file_written``, ``save.before_manifest``, ``save.before_rename``,
``save.before_catalog``, ``save.shard_written`` (a rank's share of a sharded save),
``verify.read``, and ``gc.delete``, whose ``@<N>`` counts deletion steps of this process
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
from collections import Counter

ENV = "REWIND_FAULT"
ONCE_ENV = "REWIND_FAULT_ONCE"
_hits: Counter[str] = Counter()


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
    _hits[spec] += 1
    if times and _hits[spec] > int(times):
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
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
    elif action == "eio":
        raise OSError(errno.EIO, f"Input/output error (injected at {point})")
    elif action == "eacces":
        raise PermissionError(errno.EACCES, f"Permission denied (injected at {point})")
