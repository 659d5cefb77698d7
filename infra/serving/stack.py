"""The serving stack on this machine: N TorchServe instances under a supervisor, and one HAProxy per model.

``stack.json`` says where the instances answer; the supervisor (:mod:`rewind.infra.serving.supervisor`)
writes it and rewrites it when it restarts an instance. Instance 0 lives in the stack directory
itself (its ``key_file.json`` holds the key clients use), instance i in ``instance-i/``. A
TorchServe started some other way can be described by writing it by hand
(``{"inference": URL, "management": URL, "directory": DIR}``, the key file in DIR).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rewind.infra import config, stopping
from rewind.infra.errors import ConfigError, ServingUnavailable
from rewind.infra.launch.process import is_running, stop_group
from rewind.infra.serving import torchserve
from rewind.infra.serving.haproxy import Keys, Proxy
from rewind.infra.serving.torchserve import Endpoints

log = logging.getLogger("rewind.serving")
STACK_FILE = "stack.json"
SUPERVISOR = "rewind.infra.serving.supervisor"


@dataclass(frozen=True, slots=True)
class Stack:
    endpoints: Endpoints  # instance 0
    pid: int | None  # set when Rewind started TorchServe itself
    instances: tuple[Endpoints, ...] = ()
    pids: tuple[int, ...] = ()
    supervisor: int | None = None

    @property
    def directory(self) -> Path:
        return self.endpoints.directory

    @property
    def all(self) -> tuple[Endpoints, ...]:
        return self.instances or (self.endpoints,)

    def proxy(self, model: str) -> Proxy:
        return Proxy(self.directory / "proxy" / model)

    def proxies(self) -> list[Proxy]:
        return [Proxy(p) for p in sorted((self.directory / "proxy").glob("*")) if p.is_dir()]

    def keys(self, kept: dict[str, float] | None = None) -> Keys:
        """Keys clients may use through the proxies: every instance's current one, plus unexpired ``kept``."""
        current = [torchserve.inference_keys(ep) for ep in self.all]
        now = time.time()
        accepted = {k for k, at in (kept or {}).items() if at > now} | {k for c in current for k in c}
        return Keys(frozenset(accepted), tuple(next(iter(c), "") for c in current))


def _endpoints(raw: dict[str, str], directory: Path) -> Endpoints:
    return Endpoints(raw["inference"], raw["management"], Path(raw.get("directory") or directory))


def load(directory: Path | None = None) -> Stack:
    directory = directory or config.serving_home()
    path = directory / STACK_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no serving stack at {directory}: start one with `rewind serving start`") from None
    except ValueError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}") from exc
    try:
        ep = _endpoints(raw, directory)
        instances = tuple(_endpoints(i, directory) for i in raw.get("instances", []))
    except KeyError as exc:
        raise ConfigError(f"{path} lacks {exc}") from None
    return Stack(ep, raw.get("pid"), instances, tuple(raw.get("pids", [])), raw.get("supervisor"))


def write(directory: Path, instances: list[Endpoints], pids: list[int], supervisor: int | None) -> None:
    """Record where the instances answer (atomically: readers never see half a file)."""
    body = {**instances[0].as_dict(), "pid": pids[0], "instances": [ep.as_dict() for ep in instances],
            "pids": pids, "supervisor": supervisor}  # fmt: skip
    tmp = directory / f".{STACK_FILE}.tmp"
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(directory / STACK_FILE)


def _up(directory: Path) -> Stack | None:
    try:
        current = load(directory)
    except ConfigError:
        return None
    client = torchserve.TorchServe(current.endpoints, timeout_s=5)
    try:
        return current if client.ping() else None
    finally:
        client.close()


def start(
    directory: Path | None = None,
    *,
    inference_port: int | None = None,
    instances: int = 1,
    timeout_s: float = 180,
) -> Stack:
    """Start ``instances`` TorchServe servers under a supervisor unless this directory's stack is up."""
    directory = directory or config.serving_home()
    if (current := _up(directory)) is not None:
        return current
    if instances < 1:
        raise ConfigError(f"--instances must be at least 1, got {instances}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STACK_FILE).unlink(missing_ok=True)
    argv = [sys.executable, "-m", SUPERVISOR, str(directory), "--instances", str(instances)]
    argv += ["--port", str(inference_port)] if inference_port else []
    with open(directory / "supervisor.out", "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            st = load(directory)
            if st.supervisor == proc.pid:
                return st
        except ConfigError:
            pass  # not written yet
        if proc.poll() is not None:
            tail = (directory / "supervisor.out").read_text(errors="replace").strip().splitlines()[-1:]
            raise ServingUnavailable(f"the serving stack did not start: {' '.join(tail) or proc.returncode}")
        if time.monotonic() > deadline:
            stop_group(proc.pid)
            raise ServingUnavailable(f"the serving stack did not start within {timeout_s:.0f}s")
        stopping.sleep(0.1)


def stop(directory: Path | None = None) -> None:
    """Stop every proxy, the supervisor (which stops its instances), then any instance left; bounded."""
    stack = load(directory)
    for proxy in stack.proxies():
        proxy.stop()
    if stack.supervisor is not None and is_running(stack.supervisor, SUPERVISOR):
        stop_group(stack.supervisor, timeout_s=30)
    for pid in stack.pids or ((stack.pid,) if stack.pid is not None else ()):
        if is_running(pid, "torchserve"):
            stop_group(pid)
        elif stack.supervisor is None:
            log.warning("pid %d in %s is no longer TorchServe: left alone", pid, STACK_FILE)
    (stack.directory / STACK_FILE).unlink(missing_ok=True)
