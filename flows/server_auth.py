"""The credential of a Prefect server that `rewind server` starts, and how this machine's clients find it.

Prefect's server refuses API calls without HTTP basic auth once
``PREFECT_SERVER_API_AUTH_STRING`` is set. `rewind server` generates a credential on
first use and keeps it in ``$REWIND_HOME/prefect-auth`` (mode 0600); every `rewind`
command run by the same user then sets ``PREFECT_API_AUTH_STRING`` from it, unless
one is already set. The credential is never printed.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from rewind.infra import config
from rewind.infra.errors import ConfigError

CLIENT_ENV = "PREFECT_API_AUTH_STRING"
SERVER_ENV = "PREFECT_SERVER_API_AUTH_STRING"


def path() -> Path:
    return config.home() / "prefect-auth"


def ensure() -> str:
    """This machine's credential, created (user ``rewind``, a random secret, mode 0600) if there is none."""
    p = path()
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"rewind:{secrets.token_urlsafe(24)}\n")
    return read(p)


def read(p: Path) -> str:
    if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{p} is readable by others: chmod 600 it (it holds the Prefect server's credential)"
        )
    return p.read_text().strip()


def use_in_clients() -> None:
    """Make this process a client of the local `rewind server`, if there is a credential and none is set."""
    p = path()
    if CLIENT_ENV not in os.environ and p.exists():
        os.environ[CLIENT_ENV] = read(p)
