"""An S3 service whose metadata server fails over: what the ``storage-failover`` drill runs against.

SeaweedFS as a small HA deployment on loopback: one master, one volume server, and two filers (the
metadata service; each serves S3 too) that keep their metadata in one shared PostgreSQL store, behind a
TCP front (HAProxy) that sends every client to filer A while it is up and to filer B (its backup) once A's
health check fails. The client's endpoint never changes: failing filer A over to B is what a metadata
node's loss looks like to a client of an HA object store (a load balancer or a virtual address in front).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewind.infra.drills.servers import ACCESS_KEY, SECRET_KEY, PostgresCluster, Spawned, weed_binary
from rewind.infra.errors import RewindError
from rewind.infra.launch.process import program
from rewind.infra.net import LOOPBACK, free_port

_UPSERT = (
    'INSERT INTO "%[1]s" (dirhash,name,directory,meta) VALUES($1,$2,$3,$4) '
    "ON CONFLICT (dirhash,name) DO UPDATE SET meta = EXCLUDED.meta"
)
_FILER_TOML = """[postgres2]
enabled = true
createTable = '''
  CREATE TABLE IF NOT EXISTS "%s" (
    dirhash BIGINT, name VARCHAR(65535), directory VARCHAR(65535), meta bytea, PRIMARY KEY (dirhash, name)
  );
'''
hostname = "{host}"
port = {port}
username = "postgres"
password = ""
database = "{database}"
schema = ""
sslmode = "disable"
connection_max_idle = 10
connection_max_open = 20
connection_max_lifetime_seconds = 0
enableUpsert = true
upsertQuery = '''{upsert}'''
"""
_FRONT = """global
  maxconn 256
defaults
  mode tcp
  timeout connect 2s
  timeout client 120s
  timeout server 120s
  retries 3
  option redispatch
frontend s3
  bind {host}:{port}
  default_backend filers
backend filers
  server a {host}:{a} check inter 200ms fall 1 rise 2
  server b {host}:{b} check inter 200ms fall 1 rise 2 backup
"""
_FILER_PORTS = ("port", "port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance")


def _filer_ports() -> dict[str, int]:
    """A filer's listeners. Its gRPC port must be its HTTP port + 10000: the S3 server inside a filer dials
    the filer there whatever ``-port.grpc`` says (on any other port it waits forever, silently)."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536 and _free(port + 10000):
            others = {k: free_port() for k in _FILER_PORTS if not k.startswith("port")}
            return {"port": port, "port.grpc": port + 10000, **others}
    raise RewindError("no pair of free loopback ports 10000 apart for a SeaweedFS filer")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


@dataclass
class _Process(Spawned):
    name: str
    proc: subprocess.Popen[bytes] | None = None

    def kill(self) -> None:
        """SIGKILL its whole process group (a crashed node: nothing flushed, nothing said goodbye)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None


@dataclass
class FailoverS3:
    """The HA deployment; ``endpoint`` is the front every client uses, ``fail_over`` kills filer A."""

    data: Path
    front_port: int = field(default_factory=free_port)
    master_ports: tuple[int, int] = field(default_factory=lambda: (free_port(), free_port()))
    volume_ports: tuple[int, int] = field(default_factory=lambda: (free_port(), free_port()))
    filer_ports: list[dict[str, int]] = field(default_factory=lambda: [_filer_ports() for _ in range(2)])
    procs: dict[str, _Process] = field(default_factory=dict)
    pg: PostgresCluster | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.front_port}"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip

    def client(self, endpoint: str | None = None) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=3, read_timeout=30),
        )  # fmt: skip

    def filer_s3(self, i: int) -> str:
        return f"http://{LOOPBACK}:{self.filer_ports[i]['s3.port']}"

    def start(self, timeout: float = 120) -> None:
        """The metadata store, master, volume server, filer A then B (one at a time: both creating the
        store's table at once collide), then the front; each waited for (bounded)."""
        self.data.mkdir(parents=True, exist_ok=True)
        self.pg = PostgresCluster(self.data / "filer-store", database="seaweedfs")
        self.pg.start()
        weed, master = weed_binary(), f"{LOOPBACK}:{self.master_ports[0]}.{self.master_ports[1]}"
        bind = [f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}"]
        (self.data / "master").mkdir(exist_ok=True)
        self._start(
            "master",
            [
                weed,
                "master",
                *bind,
                f"-port={self.master_ports[0]}",
                f"-port.grpc={self.master_ports[1]}",
                f"-mdir={self.data / 'master'}",
            ],
            lambda: _json(f"http://{LOOPBACK}:{self.master_ports[0]}/cluster/status").get("IsLeader"),
            timeout,
        )  # fmt: skip  (a filer started before the master leads never starts its S3 server)
        (self.data / "volume").mkdir(exist_ok=True)
        self._start("volume", [weed, "volume", *bind, f"-port={self.volume_ports[0]}",
                               f"-port.grpc={self.volume_ports[1]}", f"-dir={self.data / 'volume'}",
                               f"-master={master}", "-max=20"],
                    lambda: f":{self.volume_ports[0]}" in json.dumps(
                        _json(f"http://{LOOPBACK}:{self.master_ports[0]}/dir/status")), timeout)  # fmt: skip
        for i, name in enumerate(("filer-a", "filer-b")):
            self._start_filer(i, name, master, timeout)
        cfg = self.data / "front.cfg"
        a, b = (p["s3.port"] for p in self.filer_ports)
        cfg.write_text(_FRONT.format(host=LOOPBACK, port=self.front_port, a=a, b=b))
        front = [program("haproxy", "Debian/Ubuntu: apt-get install haproxy"), "-f", str(cfg), "-db"]
        self._start("front", front, lambda: self.client().list_buckets() is not None, timeout)

    def _start_filer(self, i: int, name: str, master: str, timeout: float) -> None:
        assert self.pg is not None
        conf = self.data / name
        conf.mkdir(exist_ok=True)
        (conf / "filer.toml").write_text(_FILER_TOML.format(
            host=LOOPBACK, port=self.pg.port, database=self.pg.database, upsert=_UPSERT))  # fmt: skip
        ports = [f"-{'s3.' if k.startswith('s3.') else ''}{k.removeprefix('s3.')}={v}"
                 for k, v in self.filer_ports[i].items()]  # fmt: skip
        cmd = [weed_binary(), f"-config_dir={conf}", "filer", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
               f"-master={master}", "-s3", *ports]  # fmt: skip
        endpoint = self.filer_s3(i)
        self._start(name, cmd, lambda: self.client(endpoint).list_buckets() is not None, timeout, cwd=conf)

    def _start(self, name: str, cmd: list[str], ready: Any, timeout: float, cwd: Path | None = None) -> None:
        p = self.procs[name] = _Process(name)
        env = {**os.environ, **self.env}
        p.spawn(cmd, env, self.data / f"{name}.log", ready, name, timeout, cwd=cwd)

    def fail_over(self, timeout: float = 30) -> float:
        """SIGKILL filer A (and the S3 server in it); returns the seconds until the front answers again
        (through filer B)."""
        killed = time.monotonic()
        self.procs["filer-a"].kill()
        deadline = killed + timeout
        while True:
            try:
                self.client().list_buckets()
                return round(time.monotonic() - killed, 3)
            except Exception as exc:  # the front has not marked A down yet
                if time.monotonic() > deadline:
                    raise RewindError(
                        f"the S3 front did not answer through filer B within {timeout:g}s: {exc}"
                    ) from exc
            time.sleep(0.1)

    def stop(self) -> None:
        """Everything, front first; the metadata store last."""
        for name in ("front", "filer-b", "filer-a", "volume", "master"):
            if name in self.procs:
                self.procs[name].stop()
        if self.pg is not None:
            self.pg.discard()


def _json(url: str) -> dict[str, Any]:
    import httpx

    got = httpx.get(url, timeout=3).json()
    return got if isinstance(got, dict) else {}
