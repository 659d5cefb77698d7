"""HAProxy in front of one model's versions: fractional traffic, changed live through the runtime API.

One HAProxy per model. Its ``versions`` backend has one server per loaded version,
named after the version, all pointing at an internal ``router`` listener; HAProxy
sends the chosen server's name in a header and the router appends it to the path,
so ``/predictions/<model>`` reaches TorchServe's ``/predictions/<model>/<version>``
on one of the stack's TorchServe instances (every instance loads every version, so
the version weights apply across instances). The router checks each instance and
retries a request that an instance dropped on another one.
Weights are server weights: ``set server ... weight`` takes effect for the next
request with no reload, and the previous version stays loaded behind weight 0.
Every server is added at run time (``add server``), so every one can be removed.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rewind.infra.errors import ConfigError, Refused, ServingUnavailable
from rewind.infra.launch.process import is_running, program, stop_group
from rewind.infra.net import LOOPBACK, free_port, socket_dir

BACKEND = "versions"
ROUTER = "router"
VERSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# What a client with a wrong key gets: TorchServe's own answer, so clients that re-read keys on it still do.
INVALID_KEY = (
    '{"code": 400, "type": "InvalidKeyException", '
    '"message": "Token Authorization failed. Token either incorrect, expired, or not provided correctly"}'
)
# A gate that cannot reach its instance answers this instead of 503: the router retries a 502 on another
# instance, but never a 503, which is also what TorchServe answers when a handler fails (a canary's real error).
INSTANCE_DOWN = (
    "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: 22\r\n"
    "Connection: close\r\n\r\ninstance not reachable"
)


@dataclass(frozen=True, slots=True)
class Keys:
    """Inference keys: the ones clients may present, and each instance's own (what its gate sends on)."""

    accepted: frozenset[str]
    instances: tuple[str, ...]


def _gate(i: int, gate_port: int, upstream: str, directory: Path) -> str:
    return f"""
listen gate{i}
    bind {LOOPBACK}:{gate_port}
    retries 0
    errorfile 503 {directory / "instance-down.http"}
    http-request set-header Authorization "Bearer %[str({i}),map({directory / "instances.map"})]"
    http-response set-header x-rewind-instance {i}
    server torchserve{i} {upstream}
"""


def admin_socket(directory: Path) -> Path:
    """The runtime API's socket: in ``directory``, or a short private one where that path is too long."""
    return socket_dir(directory, room=len("admin.sock"), tag="haproxy") / "admin.sock"


def render(*, port: int, router_port: int, gates: list[tuple[int, str]], directory: Path) -> str:
    """The whole configuration; the version servers come later, through the runtime API.

    Each TorchServe instance has a gate that swaps the client's key for the instance's own (keys
    differ per instance); the router spreads requests over the gates, checks each instance's /ping,
    and sends a request that an instance dropped (killed mid-request, refused) to another one.
    """
    servers = "".join(
        f"    server ts{i} {LOOPBACK}:{gate_port} check inter 300 fall 1 rise 1\n"
        for i, (gate_port, _) in enumerate(gates)
    )
    gated = "".join(_gate(i, gp, up, directory) for i, (gp, up) in enumerate(gates))
    return _head(port=port, router_port=router_port, directory=directory) + servers + gated


def _head(*, port: int, router_port: int, directory: Path) -> str:
    """Everything before the router's servers: logging, defaults, the client frontend, the router."""
    accepted, sock = directory / "accepted.map", admin_socket(directory)
    return f"""# Written by Rewind; weights change through the runtime API at {sock}, never by editing this.
# The last requests of every section, with their termination flags: `show events buf` on the socket.
ring buf
    size 1048576
    format raw

global
    log ring@buf local0
    stats socket {sock} mode 600 level admin
    maxconn 4096

defaults
    mode http
    log global
    option httplog
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 10s
    timeout check 2s
    option redispatch
    retries 2

frontend model
    bind {LOOPBACK}:{port}
    http-request return status 400 content-type application/json string '{INVALID_KEY}' unless {{ req.hdr(authorization),word(2,' '),map({accepted}) -m found }}
    default_backend {BACKEND}

backend {BACKEND}
    balance roundrobin
    http-send-name-header x-rewind-version
    http-response set-header x-rewind-version %[srv_name]

listen {ROUTER}
    bind {LOOPBACK}:{router_port}
    http-request set-path %[path]/%[req.hdr(x-rewind-version)] if {{ path_reg ^/predictions/[^/]+$ }}
    balance roundrobin
    # Retries need the whole request in hand when it is first sent: without this a POST whose body came
    # in a later packet is sent at once, and HAProxy silently drops its L7 retry (1 in ~200 failed).
    option http-buffer-request
    option httpchk GET /ping
    http-check expect status 200
    retry-on conn-failure empty-response response-timeout 502
    retries 5
    option redispatch 1
    # A conversation's turns go to the instance that holds its KV cache while it is up (then to another,
    # which loads the cache from the blocks' tier): the session id from a header, or the JSON body.
    stick-table type string len 200 size 100k expire 30m
    http-request set-var(txn.session) req.hdr(x-session-id)
    http-request set-var(txn.session) req.body,json_query('$.session_id') unless {{ var(txn.session) -m found }}
    stick on var(txn.session)
"""


@dataclass(frozen=True, slots=True)
class ServerStats:
    weight: int
    responses: int  # every HTTP response the version gave, 1xx-5xx
    errors: int  # 5xx answers plus failed connections and responses
    current: int  # requests in flight now


# Every answer of HAProxy's runtime API to a change that took (2.4 to 3.x): anything else is a refusal.
ACCEPTED = frozenset({"", "New server registered.", "Server deleted."})


class Proxy:
    """The HAProxy of one model, kept in ``directory`` (config, socket, pid, ports)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.state_file = directory / "proxy.json"

    @functools.cached_property
    def socket(self) -> Path:
        """The runtime API's socket (worked out when first used: naming a proxy creates nothing)."""
        return admin_socket(self.directory)

    # -- lifecycle ------------------------------------------------------------------

    def state(self) -> dict[str, int | str] | None:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None

    def _started(self) -> dict[str, int | str]:
        st = self.state()
        if st is None:
            raise ConfigError(f"no proxy in {self.directory}")
        return st

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._started()['port']}"

    def running(self) -> bool:
        if self.state() is None or not self.socket.exists():
            return False
        try:
            self.command("show info")
        except ServingUnavailable:
            return False
        return True

    def start(
        self, upstreams: list[str], keys: Keys, *, port: int | None = None, timeout_s: float = 20
    ) -> str:
        """Start HAProxy (daemonised, its own session) unless it already runs; returns its URL."""
        if self.running():
            return self.url
        binary = program("haproxy", "Debian/Ubuntu: apt-get install haproxy")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        port, router_port = port or free_port(), free_port()
        gates = [(free_port(), upstream) for upstream in upstreams]
        (self.directory / "instance-down.http").write_text(INSTANCE_DOWN)
        self._write_maps(keys)
        config = self.directory / "haproxy.cfg"
        config.write_text(render(port=port, router_port=router_port, gates=gates, directory=self.directory))
        check = subprocess.run([binary, "-c", "-q", "-f", str(config)], capture_output=True, text=True)
        if check.returncode != 0:
            raise ConfigError(f"haproxy rejected {config}: {check.stderr.strip() or check.stdout.strip()}")
        pid_file = self.directory / "haproxy.pid"
        with open(self.directory / "haproxy.out", "ab") as out:
            subprocess.run(
                [binary, "-D", "-f", str(config), "-p", str(pid_file)],
                stdout=out, stderr=subprocess.STDOUT, check=True, start_new_session=True, timeout=timeout_s,
            )  # fmt: skip
        pid = int(pid_file.read_text().split()[0])
        self.state_file.write_text(json.dumps({"port": port, "router_port": router_port, "pid": pid}))
        deadline = time.monotonic() + timeout_s
        while not self.running():
            if time.monotonic() > deadline:
                raise ServingUnavailable(
                    f"HAProxy in {self.directory} did not open its socket in {timeout_s}s"
                )
            time.sleep(0.05)
        return self.url

    def _write_maps(self, keys: Keys) -> None:
        for name, lines in (
            ("accepted.map", [f"{k} 1" for k in sorted(keys.accepted)]),
            ("instances.map", [f"{i} {k}" for i, k in enumerate(keys.instances)]),
        ):
            path = self.directory / name
            path.touch(mode=0o600)
            path.write_text("".join(line + "\n" for line in lines))

    def _map(self, name: str) -> dict[str, str]:
        rows = (line.split() for line in self.command(f"show map {self.directory / name}").splitlines())
        return {row[1]: row[2] for row in rows if len(row) == 3}

    def sync_keys(self, keys: Keys) -> None:
        """Make the live maps say ``keys``; a key is added before any is taken away."""
        accepted, path = self._map("accepted.map"), self.directory / "accepted.map"
        for key in sorted(keys.accepted - accepted.keys()):
            self.command(f"add map {path} {key} 1")
        instances, path = self._map("instances.map"), self.directory / "instances.map"
        for i, key in enumerate(keys.instances):
            if str(i) not in instances:
                self.command(f"add map {path} {i} {key}")
            elif instances[str(i)] != key:
                self.command(f"set map {path} {i} {key}")
        for key in sorted(accepted.keys() - keys.accepted):
            self.command(f"del map {self.directory / 'accepted.map'} {key}")

    def set_instance(self, index: int, serving: bool) -> None:
        """Take an instance out of the rotation (maintenance) or put it back."""
        self.command(f"{'enable' if serving else 'disable'} server {ROUTER}/ts{index}")

    def instances(self) -> dict[int, str]:
        """The router's view of each instance: UP, DOWN, MAINT..."""
        raw = self.command("show stat").lstrip("# ")
        return {
            int(row["svname"][2:]): row["status"]
            for row in csv.DictReader(raw.splitlines())
            if row.get("pxname") == ROUTER and row.get("svname", "").startswith("ts")
        }

    def stop(self) -> None:
        st = self.state()
        if st is not None:
            if is_running(int(st["pid"]), "haproxy"):  # a stale pid may be an unrelated process now
                stop_group(int(st["pid"]), timeout_s=10)
            self.state_file.unlink(missing_ok=True)
            if self.socket.parent != self.directory:  # a short private directory of its own: gone with it
                with contextlib.suppress(OSError):
                    self.socket.unlink(missing_ok=True)
                    self.socket.parent.rmdir()

    # -- runtime API -----------------------------------------------------------------

    def command(self, line: str, *, timeout_s: float = 5) -> str:
        """One runtime API command; HAProxy answers and closes the connection."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(str(self.socket))
                s.sendall(line.encode() + b"\n")
                chunks = []
                while chunk := s.recv(65536):
                    chunks.append(chunk)
        except OSError as exc:
            raise ServingUnavailable(f"HAProxy runtime API at {self.socket} is unreachable: {exc}") from exc
        answer = b"".join(chunks).decode()
        if not line.startswith("show ") and answer.strip() not in ACCEPTED:
            # HAProxy answered and said no (no such server, weight out of range, unknown
            # command): asking again gets the same answer, so this is not transient.
            raise Refused(f"HAProxy refused {' '.join(line.split()[0:3])!r}: {answer.strip()[:200]}")
        return answer

    def add(self, version: str, upstream_weight: int = 0) -> None:
        """Add a version's server (weight 0 unless told) and put it in service."""
        if not VERSION_NAME.match(version):
            raise ConfigError(f"version {version!r}: use letters, digits, '.', '_' or '-'")
        if version in self.stats():
            return
        router = self._router()
        self.command(f"add server {BACKEND}/{version} {router} weight {upstream_weight}")
        self.command(f"enable server {BACKEND}/{version}")

    def set_weights(self, weights: dict[str, int]) -> None:
        """Raise weights before lowering others, so no moment has every server at 0."""
        order = sorted(weights.items(), key=lambda kv: -kv[1])
        for version, weight in order:
            self.command(f"set server {BACKEND}/{version} weight {int(weight)}")

    def remove(self, version: str, *, drain_s: float = 30) -> None:
        """Take a version out: weight 0, wait (bounded) for its requests to finish, then delete it."""
        if version not in self.stats():
            return
        self.command(f"set server {BACKEND}/{version} weight 0")
        deadline = time.monotonic() + drain_s
        while self.stats()[version].current and time.monotonic() < deadline:
            time.sleep(0.05)
        self.command(f"disable server {BACKEND}/{version}")
        self.command(f"del server {BACKEND}/{version}")

    def stats(self) -> dict[str, ServerStats]:
        """Per version: weight and cumulative response/error counters since it was added."""
        raw = self.command("show stat").lstrip("# ")
        out = {}
        for row in csv.DictReader(raw.splitlines()):
            if row.get("pxname") != BACKEND or row.get("svname") in ("BACKEND", "FRONTEND"):
                continue

            def n(field: str, row: dict[str, str] = row) -> int:
                return int(row.get(field) or 0)

            responses = sum(n(f"hrsp_{k}xx") for k in range(1, 6)) + n("hrsp_other")
            out[row["svname"]] = ServerStats(
                weight=n("weight"),
                responses=responses,
                errors=n("hrsp_5xx") + n("econ") + n("eresp"),
                current=n("scur"),
            )
        return out

    def _router(self) -> str:
        return f"{LOOPBACK}:{self._started()['router_port']}"
