"""``rewind server``: Prefect's server and UI started for this user, bound to 127.0.0.1 unless asked, with
basic auth on (``--no-auth`` to go without) and the UI told which API it calls."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rewind.infra import config
from rewind.infra.errors import ConfigError


def cmd_server(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rewind.flows import server_auth, ui_login

    args.port = server_port(args.port)
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", args.host, "--port", str(args.port)]
    env = dict(os.environ)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # nothing leaves the machine unasked
    # Prefect's home (its database, profiles) under REWIND_HOME unless the user chose one: two setups
    # on one account never show each other's runs.
    env.setdefault("PREFECT_HOME", str(config.home() / "prefect"))
    if args.no_auth:
        env.pop(server_auth.SERVER_ENV, None)
        how = "no authentication (--no-auth): anyone who reaches the port can run flows"
    else:
        env[server_auth.SERVER_ENV] = server_auth.ensure()
        how = f"basic auth on; the credential is in {server_auth.path()} (mode 0600), used by this user's clients"
    ui_api, ui_how = ui_api_url(args.host, args.port)
    if ui_how != "given":
        env[UI_API_ENV] = ui_api
    if not args.no_auth and "PREFECT_UI_STATIC_DIRECTORY" not in env:
        static = (
            Path(env["PREFECT_HOME"]) / "ui-static"
        )  # Prefect's UI with the login guard (flows/ui_login.py)
        if ui_login.prepare(static):
            env["PREFECT_UI_STATIC_DIRECTORY"] = str(static)
    print(f"starting the Prefect server and UI on {args.host}:{args.port}, {how}", flush=True)
    print(
        f"the UI calls the API at {ui_api} ({UI_HOW[ui_how]}); Prefect's home is {env['PREFECT_HOME']}",
        flush=True,
    )
    os.execve(cmd[0], cmd, env)
    return 0


def server_port(given: int | None) -> int:
    """``--port``, else Prefect's own setting for it (as `prefect server start` reads it), else 4200."""
    if given is not None:
        return given
    text = os.environ.get("PREFECT_SERVER_API_PORT", "4200")
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"PREFECT_SERVER_API_PORT={text!r} is not a port number")
    return int(text)


UI_API_ENV = "PREFECT_SERVER_UI_API_URL"  # Prefect 3 (PREFECT_UI_API_URL is its older alias)
UI_HOW = {
    "given": "set explicitly: PREFECT_UI_API_URL, PREFECT_SERVER_UI_API_URL or the Prefect profile",
    "own": "this server's own host and port; PREFECT_UI_API_URL overrides it",
    "wildcard": "the server listens on every address: browsers on other machines need "
    "PREFECT_UI_API_URL set to the address they reach",
}


def ui_api_url(host: str, port: int, settings: Any = None) -> tuple[str, str]:
    """The API URL the UI's pages are told to call, and why: ``given`` (an explicit Prefect setting),
    ``own`` (this server's host and port) or ``wildcard`` (loopback, for a server bound to every address).

    Left alone, Prefect's UI calls ``PREFECT_API_URL`` or the default port 4200, not the port the server
    was started on: every page would say it cannot connect to the server API.
    """
    from prefect.settings import get_current_settings

    ui = (settings or get_current_settings()).server.ui
    if "api_url" in ui.model_fields_set and ui.api_url:  # env (either name), profile or prefect.toml
        return ui.api_url, "given"
    wildcard = host in ("", "0.0.0.0", "::", "[::]")
    name = "127.0.0.1" if wildcard else host
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"  # an IPv6 address in a URL
    return f"http://{name}:{port}/api", "wildcard" if wildcard else "own"
