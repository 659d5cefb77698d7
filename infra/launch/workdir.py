"""Where a job runs when its spec names no directory and the flow that starts it runs in a directory that goes
with the flow run.

A Prefect process worker without a ``working_dir`` runs each flow run in a temporary directory it deletes when
the run ends (``/tmp/tmp...prefect``, or a directory inside one that a pull step made): a job started there
would write its output into it, and a recovery would relaunch it in another. There the job gets a directory
of its own under Rewind's home, ``jobs/<run>``, recorded in its spec (made again by a relaunch on a host
that lacks it). Anywhere else a spec without a directory stays so: the job runs where its launcher runs.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from rewind.infra import config
from rewind.infra.errors import ConfigError

log = logging.getLogger("rewind.launch")

WORKSPACE_SUFFIX = "prefect"  # a process worker's per-run ``tempfile.TemporaryDirectory(suffix="prefect")``


def temporary_workspace(path: Path) -> bool:
    """Whether ``path`` lies in a directory a Prefect process worker made for one flow run (and deletes
    after it)."""
    tmp = Path(tempfile.gettempdir()).resolve()
    return any(p.parent == tmp and p.name.endswith(WORKSPACE_SUFFIX) for p in (path, *path.parents))


def job_home(run: str) -> Path:
    """The run's own working directory, for a job launched from a worker's temporary workspace."""
    return config.home() / "jobs" / run


def job_cwd(run: str, given: str | None) -> str | None:
    """The working directory to record in ``run``'s spec for ``given`` (None or empty: none given): as given,
    or none; in a worker's temporary workspace, ``job_home(run)`` (made), and a relative one refused."""
    try:
        here = Path.cwd().resolve()
    except FileNotFoundError:  # the flow run's directory is already gone
        here = None
    if here is None or not temporary_workspace(here):
        return given or None
    if given:
        if not Path(given).expanduser().is_absolute():
            raise ConfigError(
                f"cwd {given!r} is relative, and this flow run's directory {here} is the worker's, deleted when "
                "the run ends: give an absolute path"
            )
        return given
    own = job_home(run)
    own.mkdir(parents=True, exist_ok=True, mode=0o700)
    log.warning(
        "this flow run's directory %s is the worker's, deleted when the run ends: the job runs in %s (give cwd, "
        "or the work pool's working_dir, to choose)",
        here,
        own,
    )
    return str(own)


def ready(run: str, cwd: str | None) -> None:
    """``run``'s own directory made where its spec names it and this host lacks it (a relaunch on another
    worker's host); any other directory is the job's to have."""
    if cwd is not None and Path(cwd) == job_home(run):
        Path(cwd).mkdir(parents=True, exist_ok=True, mode=0o700)
