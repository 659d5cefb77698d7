"""A screenshot of the Prefect UI that `rewind server` serves, with Rewind's deployments, for the README.

    .venv/bin/python docs/screenshot.py [OUT.png]     # default docs/ui-deployments.png

Starts `rewind server` on a free port (its own home under a temporary directory, basic auth on),
`rewind serve` against it, logs a headless Chromium in (apt-get install chromium) and photographs the
deployments page once it lists them. Everything it started is stopped afterwards.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(out: Path) -> int:
    import httpx

    from rewind.infra.net import free_port
    from tests.prefect_support import rewind_serve, wait_until
    from tests.ui_support import browser, chromium, log_in, rewind_server

    if chromium() is None:
        print("no chromium on this machine: apt-get install chromium", file=sys.stderr)
        return 1
    home = Path(tempfile.mkdtemp(prefix="rewind-screenshot-"))
    wanted = {"protect-training", "recover-training", "verify-checkpoints", "restore-checkpoint"}
    with (
        rewind_server(home, free_port()) as server,
        rewind_serve(server.api, {"REWIND_HOME": str(home)}) as serve,
    ):

        def registered() -> bool:
            assert serve.poll() is None, (home / "serve.log").read_text()[-3000:]
            r = httpx.post(f"{server.api}/deployments/filter", json={}, timeout=5, auth=server.auth)
            ready = (
                {d["name"] for d in r.json() if d.get("status") == "READY"} if r.status_code == 200 else set()
            )
            return wanted <= ready  # its runner polled: the UI shows them Ready

        wait_until(registered, 120, "rewind serve's deployments, ready")
        with browser() as page:
            log_in(page, server)
            page.goto(f"{server.base}/deployments")
            page.wait_for_text(lambda t: all(w in t for w in wanted), 60, "the deployments page")
            page.screenshot(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "ui-deployments.png"))
