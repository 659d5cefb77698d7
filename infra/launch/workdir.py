"""Where a job runs when its spec names no directory: a directory that outlives the flow run that started it.

A job's spec records its working directory as an absolute path, so a recovery relaunches it where it ran,
whichever process (the CLI, ``rewind serve``, a worker) does the relaunch. Left out, it is the directory the
flow runs in, except where that directory goes with the flow run: a Prefect process worker without a
``working_dir`` runs each flow run in a temporary directory it deletes when the run ends (the job's output
would go with it, and a recovery would relaunch in another). There the job gets a directory of its own
under Rewind's home, ``jobs/<run>``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from rewind.infra import config
from rewind.infra.errors import ConfigError

log = logging.getLogger("rewind.launch")

WORKSPACE_SUFFIX = "prefect"  # a process worker's per-run ``tempfile.TemporaryDirectory(suffix="prefect")``


def temporary_workspace(path: Path) -> bool:
    """Whether ``path`` is a directory a Prefect process worker made for one flow run (and deletes after it)."""
    return path.parent == Path(tempfile.gettempdir()).resolve() and path.name.endswith(WORKSPACE_SUFFIX)


def job_home(run: str) -> Path:
    """The run's own working directory, for a job launched from a worker's temporary workspace."""
    return config.home() / "jobs" / run


def job_cwd(run: str, given: str | None) -> str:
    """The absolute working directory to record in ``run``'s spec for ``given`` (None or empty: none given).

    A relative ``given`` is taken from the directory the flow runs in, which must then outlive the run."""
    here = Path.cwd().resolve()
    away = temporary_workspace(here)
    if given:
        if away and not Path(given).expanduser().is_absolute():
            raise ConfigError(
                f"cwd {given!r} is relative, and this flow run's directory {here} is the worker's, deleted when "
                "the run ends: give an absolute path"
            )
        return os.path.abspath(here / Path(given).expanduser())
    if not away:
        return str(here)
    own = job_home(run)
    own.mkdir(parents=True, exist_ok=True, mode=0o700)
    log.warning(
        "this flow run's directory %s is the worker's, deleted when the run ends: the job runs in %s (give cwd, "
        "or the work pool's working_dir, to choose)",
        here,
        own,
    )
    return str(own)
