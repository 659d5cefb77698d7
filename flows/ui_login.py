"""The UI's pages lead to its login while the browser holds no credential (a server with basic auth).

Left alone, Prefect's UI opened at ``/deployments`` before logging in shows "Create a deployment to get
started" and an "Authentication failed" toast, which reads as "nothing is deployed". Before `rewind
server` starts Prefect's server, it has Prefect copy its UI bundles (Prefect's own code, so any version's
layout) into a static directory under Prefect's home, and adds one small script to each bundle's
``index.html``: with no credential kept in the page and the server asking for basic auth, any page but
the login goes to ``/login?redirect=<the page>``; the login form then returns there. Prefect serves the
copy as it is while its cache key (version, base path) matches; a new Prefect copies afresh, and the next
`rewind server` adds the script again.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("rewind.server")

MARK = "rewind-login-guard"
CREDENTIAL_KEY = "prefect-password"  # where Prefect's UI keeps the credential a person pasted
GUARD = (
    f'<script id="{MARK}">(function(){{try{{'
    "var p=location.pathname;"
    f"if(/\\/login\\/?$/.test(p)||localStorage.getItem('{CREDENTIAL_KEY}'))return;"
    "fetch('/ui-settings').then(function(r){return r.json()}).then(function(s){"
    "if(s&&s.auth==='BASIC')location.replace('/login?redirect='+encodeURIComponent(p+location.search))"
    "}).catch(function(){})"
    "}catch(e){}})()</script>"
)


def prepare(static_root: Path) -> bool:
    """Copy Prefect's UI into ``static_root`` (as its server would) and add the guard; False if it could
    not (the UI then works as Prefect ships it: the reason is logged, the server still starts)."""
    from prefect.settings import (
        PREFECT_UI_ENABLED,
        PREFECT_UI_SERVE_BASE,
        PREFECT_UI_STATIC_DIRECTORY,
        temporary_settings,
    )

    if PREFECT_UI_SERVE_BASE.value() not in ("/", ""):  # the guard's paths assume the UI at the root
        return False
    try:
        from prefect.server.api.server import create_ui_app

        with temporary_settings(
            updates={PREFECT_UI_STATIC_DIRECTORY: str(static_root), PREFECT_UI_ENABLED: True}
        ):
            create_ui_app(ephemeral=False)
        pages = [p for p in static_root.rglob("index.html") if p.is_file()]
        for page in pages:
            guard(page)
        return bool(pages)
    except Exception as exc:
        log.warning("the UI's pages will not lead to the login before it: %s", exc)
        return False


def guard(page: Path) -> None:
    """Add the guard to one ``index.html`` as the first thing its ``<head>`` runs; once."""
    html = page.read_text(encoding="utf-8")
    if MARK in html:
        return
    head = html.find("<head>")
    if head < 0:
        raise ValueError(f"{page} has no <head>")
    at = head + len("<head>")
    page.write_text(html[:at] + GUARD + html[at:], encoding="utf-8")
