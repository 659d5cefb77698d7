"""`rewind server` as its own process, and a real headless Chromium driven over the DevTools protocol.

Shared by the UI test in tests/test_flows.py and by docs/screenshot.py (the README's screenshot). The
browser logs in the way a person does: Prefect's UI keeps the pasted credential in its page's
``localStorage`` under ``prefect-password`` (base64), and sends it with every API call.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.prefect_support import REPO, stop_group, wait_until

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
CREDENTIAL_KEY = "prefect-password"  # where Prefect's UI (v1 and v2) keeps the credential a user pasted


def chromium() -> str | None:
    """The headless browser on this machine, or None (Debian: apt-get install chromium)."""
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


# -- the server ------------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base: str  # http://127.0.0.1:PORT
    log: Path
    credential: str | None  # user:password, None with --no-auth

    @property
    def api(self) -> str:
        return f"{self.base}/api"

    @property
    def auth(self) -> tuple[str, str] | None:
        if self.credential is None:
            return None
        user, password = self.credential.split(":", 1)
        return user, password


def server_env(home: Path) -> dict[str, str]:
    """For a server `rewind server` starts under ``home``: its Prefect home (and database) is the one
    `rewind server` chooses by itself, ``$REWIND_HOME/prefect`` (the session's PREFECT_HOME is removed)."""
    return {
        "REWIND_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "true",
    }


@contextmanager
def rewind_server(
    home: Path, port: int, *, no_auth: bool = False, env: dict[str, str] | None = None, timeout_s: float = 120
) -> Iterator[Server]:
    """`rewind server --port PORT` as a user starts it, until its API answers; stopped (bounded) after."""
    from rewind.flows import server_auth

    home.mkdir(parents=True, exist_ok=True)
    environ = {**os.environ, **server_env(home), **(env or {})}
    environ.pop("PREFECT_HOME", None)
    log = home / "server.log"
    argv = [sys.executable, "-m", "rewind.flows.cli", "server", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv + (["--no-auth"] if no_auth else []),
            cwd=REPO,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log, None)
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"rewind server exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                return httpx.get(f"{server.api}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s, "rewind server's API")
        if not no_auth:
            server.credential = server_auth.read(home / "prefect-auth")
        yield server
    finally:
        stop_group(proc)


# -- the browser -----------------------------------------------------------------------------------


class Page:
    """One tab of a headless Chromium, over the DevTools protocol (a websocket; every call bounded)."""

    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=None, open_timeout=30)
        self._ids = itertools.count(1)

    def call(self, method: str, timeout_s: float = 30, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if msg.get("id") == n:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        got = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in got:
            raise AssertionError(f"{expression}: {got['exceptionDetails']}")
        return got["result"].get("value")

    def goto(self, url: str, timeout_s: float = 60) -> None:
        self.call("Page.navigate", url=url)
        wait_until(
            lambda: (
                self.evaluate(f"location.href.startsWith({json.dumps(url)}) || location.href")
                and self.evaluate("document.readyState") == "complete"
            ),
            timeout_s,
            f"{url} to load",
        )

    def text(self) -> str:
        return str(self.evaluate("document.body ? document.body.innerText : ''"))

    def wait_for_text(self, ok: Callable[[str], bool], timeout_s: float, what: str) -> str:
        """The page's text once ``ok`` holds for it (bounded), as a person waits for the page to fill."""
        seen = [""]

        def probe() -> str | None:
            seen[0] = self.text()
            return seen[0] if seen[0] and ok(seen[0]) else None

        try:
            return wait_until(probe, timeout_s, what, interval=0.25)
        except TimeoutError as exc:  # what the page showed instead, for whoever reads the failure
            raise TimeoutError(f"{exc}; the page showed: {' '.join(seen[0].split())[:1500]!r}") from None

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@contextmanager
def browser(width: int = 1440, height: int = 900, timeout_s: float = 60) -> Iterator[Page]:
    """A fresh headless Chromium (its own profile) and one page in it; the browser is stopped after."""
    exe = chromium()
    assert exe is not None, "no chromium on this machine"
    profile = Path(tempfile.mkdtemp(prefix="rewind-chromium-"))
    proc = subprocess.Popen(
        [
            exe,
            "--headless",
            "--no-sandbox",  # tests run as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",  # the port it chose is written to DevToolsActivePort
            f"--window-size={width},{height}",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    page: Page | None = None
    try:
        active = profile / "DevToolsActivePort"
        wait_until(
            lambda: active.exists() and active.read_text().strip(), timeout_s, "chromium's DevTools port"
        )
        port = int(active.read_text().split()[0])
        target = httpx.put(f"http://127.0.0.1:{port}/json/new?about:blank", timeout=30).json()
        page = Page(target["webSocketDebuggerUrl"])
        page.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        yield page
    finally:
        if page is not None:
            page.ws.close()
        stop_group(proc, timeout=10)
        shutil.rmtree(profile, ignore_errors=True)


def log_in(page: Page, server: Server) -> None:
    """What a person does once: paste the credential into the UI (kept by the page, as the UI keeps it)."""
    page.goto(f"{server.base}/ui-settings")  # any page of the server's origin
    if server.credential is not None:
        token = base64.b64encode(server.credential.encode()).decode()
        page.evaluate(f"localStorage.setItem({json.dumps(CREDENTIAL_KEY)}, {json.dumps(token)})")
