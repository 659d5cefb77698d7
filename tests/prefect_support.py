"""A real Prefect server for the tests, and a real `rewind serve` process against it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from rewind.infra.launch.process import find_pids
from rewind.infra.launch.process import stop_group as stop_process_group

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def wait_until(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.25) -> T:
    """Poll ``probe`` until it returns something truthy; bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextmanager
def rewind_serve(api_url: str, env: dict[str, str], *extra: str) -> Iterator[subprocess.Popen]:
    """Run `rewind serve` as its own process, as a user would; stop it (bounded) afterwards."""
    log = open(Path(env.get("REWIND_HOME", "/tmp")) / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "rewind.flows.cli", "serve", *extra],
        cwd=REPO,
        env={
            **os.environ,
            **env,
            "PREFECT_API_URL": api_url,
            "PREFECT_LOGGING_LEVEL": "INFO",
        },  # as users see it
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        stop_group(proc)
        log.close()


def stop_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    stop_process_group(proc.pid, timeout_s=timeout)


def deployment_ids(client: Any, names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        try:
            out[name] = client.read_deployment_by_name(f"{name}/{name}").id
        except Exception:
            return {}
    return out


def find_pid(*needles: str) -> int | None:
    pids = find_pids(*needles)
    return pids[0] if pids else None
