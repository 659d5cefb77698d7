"""TorchServe: start it on loopback, and drive its management and inference APIs with token auth on.

Keys are read from TorchServe's own ``key_file.json`` and never logged. A wrong or
expired key is answered with HTTP 400 ``InvalidKeyException``: the client then
re-reads the key file (keys may have been rotated), and if the key there is the one
that failed, asks TorchServe for a fresh one with the API key, once.
"""

from __future__ import annotations

import calendar
import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from rewind.infra import stopping
from rewind.infra.errors import ConfigError, NotFoundError, RewindError, ServingUnavailable, Stopped
from rewind.infra.launch.process import program, stop_group
from rewind.infra.net import LOOPBACK, free_port, socket_dir

log = logging.getLogger(__name__)

Api = Literal["inference", "management"]
KEY_FILE = "key_file.json"


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where one TorchServe answers; ``directory`` holds its config, key file, model store and logs."""

    inference: str
    management: str
    directory: Path

    @property
    def key_file(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def model_store(self) -> Path:
        return self.directory / "model-store"

    def as_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}


class TorchServeError(RewindError):
    """TorchServe refused a request; the message carries its own explanation."""


def _refusal(r: httpx.Response) -> str:
    try:
        body = r.json()
        return f"{body.get('type', '')}: {body.get('message', '')}".strip(": ")
    except ValueError:
        return r.text[:300]


def _invalid_key(r: httpx.Response) -> bool:
    return r.status_code in (400, 401) and "InvalidKeyException" in r.text


class TorchServe:
    """A client for one TorchServe; every call is bounded by ``timeout_s``."""

    def __init__(self, endpoints: Endpoints, *, timeout_s: float = 60.0) -> None:
        self.endpoints = endpoints
        self._http = httpx.Client(timeout=timeout_s)
        self._keys: dict[str, str] | None = None

    def close(self) -> None:
        self._http.close()

    # -- keys -------------------------------------------------------------------

    def _read_keys(self) -> dict[str, str]:
        path = self.endpoints.key_file
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"no TorchServe key file at {path}: is TorchServe running there with token auth on?"
            ) from None
        except ValueError as exc:
            raise ConfigError(f"TorchServe key file {path} is not JSON: {exc}") from exc
        return {
            name: entry["key"] for name, entry in raw.items() if isinstance(entry, dict) and "key" in entry
        }

    def _key(self, api: str) -> str:
        if self._keys is None:
            self._keys = self._read_keys()
        if api not in self._keys:
            raise ConfigError(f"TorchServe key file {self.endpoints.key_file} has no {api!r} key")
        return self._keys[api]

    def rotate(self, api: Api) -> None:
        """Ask TorchServe for a new key (the old one expired); it rewrites its key file."""
        r = self._http.get(
            f"{self.endpoints.management}/token",
            params={"type": api},
            headers={"Authorization": f"Bearer {self._key('API')}"},
        )
        if r.status_code != 200:
            raise ConfigError(f"TorchServe refused to issue a new {api} key: {_refusal(r)}")
        self._keys = None

    # -- requests ---------------------------------------------------------------

    def request(self, api: Api, method: str, path: str, **kwargs: Any) -> httpx.Response:
        r = self._send(api, method, path, **kwargs)
        if not _invalid_key(r):
            return r
        failed = self._key(api)
        self._keys = None  # re-read: the keys may have been rotated
        if self._key(api) == failed:
            self.rotate(api)  # same key in the file: it expired
        r = self._send(api, method, path, **kwargs)
        if _invalid_key(r):
            raise ConfigError(f"TorchServe refuses the {api} key in {self.endpoints.key_file}")
        return r

    def _send(self, api: Api, method: str, path: str, **kwargs: Any) -> httpx.Response:
        base = self.endpoints.inference if api == "inference" else self.endpoints.management
        headers = {**kwargs.pop("headers", {}), "Authorization": f"Bearer {self._key(api)}"}
        try:
            return self._http.request(method, base + path, headers=headers, **kwargs)
        except httpx.TransportError as exc:
            raise ServingUnavailable(
                f"TorchServe {api} API at {base} is unreachable ({type(exc).__name__})"
            ) from exc

    def _ok(self, r: httpx.Response, what: str) -> httpx.Response:
        if r.status_code == 404:
            raise NotFoundError(f"{what}: {_refusal(r)}")
        if r.status_code >= 500:
            raise ServingUnavailable(f"{what}: TorchServe answered {r.status_code}: {_refusal(r)}")
        if r.status_code >= 400:
            raise TorchServeError(f"{what}: {_refusal(r)}")
        return r

    # -- management ---------------------------------------------------------------

    def ping(self) -> bool:
        try:
            r = self.request("inference", "GET", "/ping")
        except ServingUnavailable:
            return False
        return r.status_code == 200 and r.json().get("status") == "Healthy"

    def register(self, archive: str, *, workers: int = 1) -> None:
        """Load one archive from the model store and wait until its workers are up."""
        params = {"url": archive, "initial_workers": workers, "synchronous": "true"}
        self._ok(self.request("management", "POST", "/models", params=params), f"registering {archive}")

    def unregister(self, model: str, version: str) -> None:
        self._ok(
            self.request("management", "DELETE", f"/models/{model}/{version}"), f"unloading {model} {version}"
        )

    def set_default(self, model: str, version: str) -> None:
        r = self.request("management", "PUT", f"/models/{model}/{version}/set-default")
        self._ok(r, f"making {model} {version} the default")

    def describe(self, model: str) -> list[dict[str, Any]]:
        """Every loaded version of ``model`` with its workers; empty when none is loaded."""
        r = self.request("management", "GET", f"/models/{model}/all")
        if r.status_code == 404:
            return []
        return list(self._ok(r, f"describing {model}").json())

    def predict(
        self, model: str, version: str | None, body: bytes, *, timeout_s: float | None = None
    ) -> httpx.Response:
        path = f"/predictions/{model}" + (f"/{version}" if version else "")
        extra = {"timeout": timeout_s} if timeout_s is not None else {}
        return self.request("inference", "POST", path, content=body, **extra)


# -- the process ------------------------------------------------------------------


def _config(inference: int, management: int, store: Path) -> str:
    metrics, grpc_inference, grpc_management = free_port(), free_port(), free_port()
    return "\n".join(
        [
            f"inference_address=http://{LOOPBACK}:{inference}",
            f"management_address=http://{LOOPBACK}:{management}",
            f"metrics_address=http://{LOOPBACK}:{metrics}",
            f"grpc_inference_address={LOOPBACK}",
            f"grpc_management_address={LOOPBACK}",
            f"grpc_inference_port={grpc_inference}",
            f"grpc_management_port={grpc_management}",
            "enable_model_api=true",  # registering versions is what this backend is for
            f"model_store={store}",
            "disable_system_metrics=true",
            "default_workers_per_model=1",
            "",
        ]
    )


def executable() -> str:
    found = program("torchserve", "pip install torchserve torch-model-archiver pyyaml")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise ConfigError("TorchServe needs Java 17: install a JDK or set JAVA_HOME")
    return found


def _temp_dir(directory: Path) -> Path:
    """TorchServe's private temp dir (pid file, the workers' Unix sockets, ``.ts.sock.9000``): ``directory/tmp``,
    or a short one where that path is too long for a socket's name."""
    return socket_dir(directory / "tmp", room=20, tag="ts")


def spawn(directory: Path, *, inference_port: int | None = None, management_port: int | None = None
          ) -> tuple[Endpoints, subprocess.Popen[bytes]]:  # fmt: skip
    """Start TorchServe on loopback in its own process group (given ports: the same ones again after a crash)."""
    directory.mkdir(parents=True, exist_ok=True)
    ep = Endpoints(
        f"http://{LOOPBACK}:{inference_port or free_port()}",
        f"http://{LOOPBACK}:{management_port or free_port()}",
        directory,
    )
    ep.model_store.mkdir(exist_ok=True)
    tmp = _temp_dir(directory)
    (tmp / ".model_server.pid").unlink(missing_ok=True)  # a killed server's: TorchServe would refuse to start
    ep.key_file.unlink(missing_ok=True)
    config = directory / "config.properties"
    config.write_text(
        _config(int(ep.inference.rsplit(":", 1)[1]), int(ep.management.rsplit(":", 1)[1]), ep.model_store)
    )
    # TorchServe keeps a pid file and worker sockets in the temp dir: a private one lets
    # several servers (and several test workers) live on one machine.
    env = {**os.environ, "TMPDIR": str(tmp), "TEMP": str(tmp), "LOG_LOCATION": str(directory / "logs")}
    with open(directory / "torchserve.out", "ab") as out:
        proc = subprocess.Popen(
            [executable(), "--start", "--foreground", "--ncs", "--ts-config", str(config),
             "--model-store", str(ep.model_store)],
            cwd=directory, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return ep, proc


def wait_ready(ep: Endpoints, proc: subprocess.Popen[bytes], *, timeout_s: float = 120) -> None:
    """Return when /ping answers Healthy; a server that exits or stays silent is stopped and refused."""
    client = TorchServe(ep, timeout_s=5)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise ServingUnavailable(
                    f"TorchServe exited with {proc.returncode}; see {ep.directory / 'torchserve.out'}"
                )
            if ep.key_file.exists():
                try:
                    if client.ping():
                        return
                except ConfigError:
                    pass  # key file half-written
            if time.monotonic() > deadline:
                stop_group(proc.pid)
                raise ServingUnavailable(f"TorchServe did not answer /ping within {timeout_s:.0f}s")
            stopping.sleep(0.2)
    except Stopped:
        stop_group(proc.pid, timeout_s=3)  # asked to stop while starting: nothing half-started is left
        raise
    finally:
        client.close()


def start(
    directory: Path, *, inference_port: int | None = None, timeout_s: float = 120
) -> tuple[Endpoints, int]:
    """Start TorchServe on loopback in its own process group; returns when /ping answers Healthy."""
    ep, proc = spawn(directory, inference_port=inference_port)
    wait_ready(ep, proc, timeout_s=timeout_s)
    return ep, proc.pid


def inference_keys(ep: Endpoints) -> dict[str, float]:
    """The inference key in the server's key file with its expiry (epoch seconds); empty while none is written."""
    try:
        entry = json.loads(ep.key_file.read_text())["inference"]
        expires = str(entry["expiration time"])[:19]  # UTC, "2026-11-30T15:07:29.600029314Z"
        return {str(entry["key"]): float(calendar.timegm(time.strptime(expires, "%Y-%m-%dT%H:%M:%S")))}
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # not written yet, or half-written: the next look sees it


def stage(source: Path, ep: Endpoints, archive: str) -> None:
    """Put an archive of the stack's model store into this server's own store (a hard link; a copy across disks)."""
    target = ep.model_store / archive
    if target.exists() or source.resolve() == ep.model_store.resolve():
        return
    ep.model_store.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source / archive, target)
    except FileNotFoundError:
        raise NotFoundError(f"archive {archive} is not in the model store {source}") from None
    except OSError:
        shutil.copy2(source / archive, target)
