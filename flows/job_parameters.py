"""A job's command, environment and directory as a flow run's parameters give them, checked before anything
is recorded or launched.

The Prefect server keeps a flow run's parameters as given and shows them in the UI and the API, so a secret
passed there is refused (set it in the worker's environment: the job inherits it). The directory is recorded
absolute (``workdir.job_cwd``), so a recovery relaunches the job where it ran.
"""

from __future__ import annotations

from collections.abc import Sequence

from rewind.infra import redact
from rewind.infra.errors import ConfigError
from rewind.infra.launch import workdir


def refuse_secrets(command: Sequence[str], env: dict[str, str] | None) -> None:
    """``ConfigError`` naming (never showing) each secret given as a parameter."""
    exposed = redact.in_plain_sight(command, env or {})
    if exposed:
        raise ConfigError(
            f"{', '.join(exposed)}: a secret in a flow run's parameters is kept and shown by the Prefect server; "
            "set it in the worker's environment (the job inherits it) or pass a file that holds it"
        )


def checked_cwd(run: str, command: Sequence[str], cwd: str | None, env: dict[str, str] | None = None) -> str:
    """The job's absolute working directory (``workdir.job_cwd``), once its parameters hold no secret."""
    refuse_secrets(command, env)
    return workdir.job_cwd(run, cwd)
