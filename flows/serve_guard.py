"""`rewind serve` runs whatever flow runs its API is asked for: it must never serve from an API that
authenticates nobody (issue 30, item 3)."""

from __future__ import annotations

import time
from typing import Any

from rewind.infra.errors import ConfigError, TransientError


def require_authenticating_api(*, allow_unauthenticated: bool = False, wait_s: float = 15.0) -> None:
    """`rewind serve` runs whatever flow runs its API is asked for: never from an API nobody authenticates.
    Without PREFECT_API_URL Prefect would start a temporary server with no authentication at all; a server
    that answers a request carrying no credential lets anyone who reaches it run commands as this user.
    Only an answer that asks for a credential (401, 403) passes; a server still starting is waited for."""
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    if not api.url:
        raise ConfigError(
            "rewind serve needs a Prefect server that authenticates its clients, and PREFECT_API_URL is not "
            "set (Prefect would start a temporary one that lets any local user start flow runs): start "
            "`rewind server`, then set PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    if allow_unauthenticated:
        return
    status = _anonymous_answer(api, wait_s)
    if status in (401, 403):
        return
    if 200 <= status < 300:
        raise ConfigError(
            f"the Prefect API at {api.url} answers requests that carry no credential, so anyone who reaches it "
            "could start flow runs that run commands as this user: use `rewind server` (basic auth), or pass "
            "--allow-unauthenticated-api if something else guards it (a firewall, an authenticating proxy)"
        )
    raise ConfigError(
        f"the Prefect API at {api.url} answered HTTP {status} to a request without a credential, not 401: "
        "is PREFECT_API_URL the API of a Prefect server (it ends in /api)?"
    )


def _anonymous_answer(api: Any, wait_s: float) -> int:
    """The status a request with no credential gets (TLS as Prefect's client is configured); a server
    that does not answer yet, or answers 5xx while it starts, is asked again until ``wait_s``."""
    import httpx

    verify: bool | str = api.ssl_cert_file or True
    if api.tls_insecure_skip_verify:
        verify = False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            status = httpx.post(
                f"{api.url.rstrip('/')}/deployments/filter", json={"limit": 1}, timeout=10, verify=verify
            ).status_code
            if status < 500 or time.monotonic() >= deadline:
                return status
        except httpx.HTTPError as e:
            if time.monotonic() >= deadline:
                raise TransientError(
                    f"the Prefect API at {api.url} does not answer ({type(e).__name__}): is the server up?"
                ) from None
        time.sleep(0.5)
