"""Where Rewind keeps things, from the environment, with embedded defaults.

``REWIND_HOME`` (default ``~/.rewind``) holds the SQLite catalog and the local
checkpoint tier unless ``REWIND_CATALOG_URL`` / ``REWIND_CHECKPOINT_ROOT`` say otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("REWIND_HOME") or Path.home() / ".rewind").expanduser()


def catalog_url() -> str:
    return os.environ.get("REWIND_CATALOG_URL") or f"sqlite:///{home() / 'catalog.db'}"


def checkpoint_root() -> Path:
    return Path(os.environ.get("REWIND_CHECKPOINT_ROOT") or home() / "checkpoints").expanduser()


def job_logs(run: str) -> Path:
    """Where the output of ``run``'s launches is kept (``infra/joblog.py``), on the supervising machine."""
    return home() / "logs" / run


def job_log_dir(run: str, launch_id: int) -> Path:
    return job_logs(run) / f"launch-{launch_id}"


def serving_home() -> Path:
    """Where `rewind serving start` keeps the serving stack: configs, key file, model store, logs."""
    return Path(os.environ.get("REWIND_SERVING_HOME") or home() / "serving").expanduser()
