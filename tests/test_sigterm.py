"""`rewind serve` stops on SIGTERM within 5 s (the serving commands' case is in test_serving.py)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tests.prefect_support import rewind_serve, wait_until

STOP_S = 5.0


def test_rewind_serve_stops_on_sigterm_within_5_s(prefect_api, rewind_env):
    log = Path(rewind_env["REWIND_HOME"]) / "serve.log"
    Path(rewind_env["REWIND_HOME"]).mkdir(parents=True, exist_ok=True)
    with rewind_serve(prefect_api, rewind_env, "--allow-unauthenticated-api") as proc:  # the harness: no auth
        wait_until(
            lambda: (
                proc.poll() is not None
                or "deployments served from this process" in log.read_text(errors="replace")
            ),
            120,
            "rewind serve to serve its deployments",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rewind serve still running {STOP_S}s after SIGTERM") from None
    assert code in (0, 128 + signal.SIGTERM), (code, log.read_text()[-3000:])
