"""A host's memory agent's own directory (its FIFO, its ``passed`` file): made private, named after the job,
and swept once its job has ended by whichever agent starts next on the host (one killed outright cannot
remove its own)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from rewind.infra.format import pids

HOME_PREFIX = "rewind-agent-"


def made() -> Path:
    """A new directory for this job's agent (0700: the FIFO is this user's alone), once this user's ended
    jobs' directories are swept (said nowhere: the task's output is the job's)."""
    tmp = Path(tempfile.gettempdir())
    with contextlib.suppress(Exception):  # housekeeping never keeps the job from starting (a deep tree...)
        sweep_stale(tmp)
    return Path(tempfile.mkdtemp(prefix=_home_prefix(), dir=tmp))


def sweep_stale(tmp: Path) -> int:
    """Remove this user's agent directories under ``tmp`` whose job has ended (an agent killed with SIGKILL
    leaves its own behind); how many. Only names of this host's boot and pid namespace are looked at (another
    host's, or a container's, pids mean nothing here). A job still running, another user's directory, or a
    name that is not an agent's is left alone; a pid since taken by another process keeps its directory
    until that ends."""
    space = pids.space()
    if space is None:
        return 0
    swept = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(tmp):
            pid = _job_pid(entry.name, space)
            if pid is None or pids.alive(pid):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if entry.is_dir(follow_symlinks=False) and st.st_uid == os.getuid():
                    shutil.rmtree(entry.path)
                    swept += 1
    return swept


def _home_prefix() -> str:
    """``rewind-agent-<host>-<job pid>-``, or ``rewind-agent-`` alone where the host cannot be told (such a
    directory is never swept)."""
    space = pids.space()
    return f"{HOME_PREFIX}{space}-{os.getpid()}-" if space is not None else HOME_PREFIX


def _job_pid(name: str, space: str) -> int | None:
    """The job's pid in the name of an agent directory of pid namespace ``space``; None for any other name."""
    pid, dash, _ = name.removeprefix(f"{HOME_PREFIX}{space}-").partition("-")
    if name.startswith(f"{HOME_PREFIX}{space}-") and dash and pid.isascii() and pid.isdigit():
        return int(pid) if 0 < int(pid) < 1 << 22 else None
    return None
