"""The serving stack on this machine: one TorchServe, and one HAProxy per model, under one directory.

``stack.json`` says where TorchServe answers; `rewind serving start` writes it, and a
TorchServe started some other way can be described by writing it by hand
(``{"inference": URL, "management": URL, "directory": DIR}``, the key file in DIR).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from infra import config
from infra.errors import ConfigError
from infra.launch.process import is_running, stop_group
from infra.serving import torchserve
from infra.serving.haproxy import Proxy
from infra.serving.torchserve import Endpoints

log = logging.getLogger("rewind.serving")
STACK_FILE = "stack.json"


@dataclass(frozen=True, slots=True)
class Stack:
    endpoints: Endpoints
    pid: int | None  # set when Rewind started TorchServe itself

    @property
    def directory(self) -> Path:
        return self.endpoints.directory

    def proxy(self, model: str) -> Proxy:
        return Proxy(self.directory / "proxy" / model)

    def proxies(self) -> list[Proxy]:
        return [Proxy(p) for p in sorted((self.directory / "proxy").glob("*")) if p.is_dir()]


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
        ep = Endpoints(raw["inference"], raw["management"], Path(raw.get("directory") or directory))
    except KeyError as exc:
        raise ConfigError(f"{path} lacks {exc}") from None
    return Stack(ep, raw.get("pid"))


def start(directory: Path | None = None, *, inference_port: int | None = None) -> Stack:
    """Start TorchServe on loopback unless this directory's is already up."""
    directory = directory or config.serving_home()
    try:
        current = load(directory)
        client = torchserve.TorchServe(current.endpoints, timeout_s=5)
        try:
            if client.ping():
                return current
        finally:
            client.close()
    except ConfigError:
        pass
    ep, pid = torchserve.start(directory, inference_port=inference_port)
    (directory / STACK_FILE).write_text(json.dumps({**ep.as_dict(), "pid": pid}, indent=1))
    return Stack(ep, pid)


def stop(directory: Path | None = None) -> None:
    """Stop every proxy, then TorchServe if Rewind started it; bounded."""
    stack = load(directory)
    for proxy in stack.proxies():
        proxy.stop()
    if stack.pid is not None and is_running(stack.pid, "torchserve"):
        stop_group(stack.pid)
    elif stack.pid is not None:
        log.warning("pid %d in %s is no longer TorchServe: left alone", stack.pid, STACK_FILE)
    (stack.directory / STACK_FILE).unlink(missing_ok=True)
