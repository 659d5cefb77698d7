"""A job's command, environment and directory as a flow run's parameters give them, checked before anything
is recorded or launched.

The Prefect server keeps a flow run's parameters as given and shows them in the UI and the API, so a secret
passed there is refused (set it in the worker's environment: the job inherits it). A job given no directory from
a worker's temporary workspace gets one of its own (``workdir.job_cwd``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rewind.infra import redact
from rewind.infra.errors import ConfigError
from rewind.infra.launch import workdir


def refuse_secrets(command: Sequence[str], env: Mapping[str, str] | None, *, submitted: bool = True) -> None:
    """``ConfigError`` naming (never showing) each secret given as a parameter; ``submitted``: the flow run
    holds it already (`rewind run` checks before it submits)."""
    exposed = redact.in_plain_sight(command, env or {})
    if exposed:
        kept = " (this flow run's parameters hold it now: rotate it)" if submitted else ""
        raise ConfigError(
            f"{', '.join(exposed)}: a secret in a flow run's parameters is kept and shown by the Prefect server"
            f"{kept}; set it in the worker's environment (the job inherits it) or pass a file that holds it"
        )


def refuse_submitted_secrets(params: Mapping[str, Any]) -> None:
    """Before a deployment's run is submitted: the secrets its ``command``, ``relaunch_command`` and ``env``
    parameters would give the Prefect server to keep (values of other types are the flow's to refuse)."""
    env = params.get("env")
    env = env if isinstance(env, dict) and all(isinstance(v, str) for v in env.values()) else None
    for name in ("command", "relaunch_command"):
        given = params.get(name)
        command = [str(a) for a in given] if isinstance(given, list) else []
        refuse_secrets(command, env, submitted=False)


def checked_cwd(
    run: str, command: Sequence[str], cwd: str | None, env: Mapping[str, str] | None = None
) -> str | None:
    """The job's working directory to record (``workdir.job_cwd``), once its parameters hold no secret."""
    refuse_secrets(command, env)
    return workdir.job_cwd(run, cwd)
