"""The supervisor's side of warm relaunches: one standby per run and node, handed the next launch.

A job spec with ``warm: true`` (a single-process ``python -m MODULE`` or ``python SCRIPT`` job on the
local launcher) gets a standby (:mod:`rewind.infra.launch.standby`) once a launch has started: it
imports what the job imports and waits, in a session of its own, so that it outlives the flow run that
started it; the recovery's supervisor, in another process, finds it by its socket (``/tmp`` or
``$XDG_RUNTIME_DIR``, 0700, named from the catalog home, the run and the node). A launch is handed to it
only when it was started for the same command and an environment that differs only in per-launch
variables; otherwise, or when it does not answer, the launch starts cold and a new standby is made.
The launch's processes are found by the standby's reports (the job's pid, then its exit status), its
output through a pipe whose write end goes with the launch. The standby is told to quit when its run
finishes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rewind.infra import config
from rewind.infra.launch.standby import PER_LAUNCH, entry_of, env_digest, stop_mark

CONNECT_TIMEOUT_S = 2.0
log = logging.getLogger("rewind.warm")


def socket_path(run: str, node: int) -> Path:
    """The standby's socket for ``run``'s node ``node`` (short: a Unix socket path holds 107 bytes), in a
    directory of this user's that nobody else can enter (one made by another user is refused: a launch's
    environment goes through that socket)."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"rewind-standby-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        base.mkdir(mode=0o700)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(
            f"{base} is not a directory of this user's closed to others: no warm relaunch through it"
        )
    name = hashlib.sha256(f"{config.home()}\0{run}\0{node}".encode()).hexdigest()[:20]
    return base / f"{name}.sock"


def eligible(command: Sequence[str]) -> bool:
    """Can a standby take over this command (``python -m MODULE`` or ``python SCRIPT``, no options)?"""
    return entry_of(command) is not None


def start(run: str, node: int, command: Sequence[str], cwd: str | None, env: Mapping[str, str]) -> None:
    """A new standby for the next launch of ``run``'s node ``node`` (in the background; not waited for)."""
    stop_mark(socket_path(run, node)).unlink(missing_ok=True)
    log = config.home() / "standby"
    log.mkdir(parents=True, exist_ok=True)
    with open(log / f"{_safe(run)}-node{node}.log", "ab") as out:
        subprocess.Popen(
            # the job's own interpreter (its packages, its torch): rewind must be installed there too
            [command[0], "-m", "rewind.infra.launch.standby", str(socket_path(run, node)), "--", *command],
            # no launch's variables: the supervisor stopping a launch finds its processes by them
            cwd=cwd, env={k: v for k, v in env.items() if k not in PER_LAUNCH}, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _safe(run: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:80]


class Handed:
    """A launch run by a standby, as the supervisor watches a process: pid, ``poll``, ``wait``, ``returncode``."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.pid, self._conn = pid, conn
        self.returncode: int | None = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name=f"rewind-warm-{pid}").start()

    def _watch(self) -> None:
        code = -9  # the standby gone without a word: the job went with it (or is beyond reach)
        with contextlib.suppress(OSError, ValueError), self._conn.makefile("rb") as f:
            for line in f:
                got = json.loads(line)
                if "exit" in got:
                    code = int(got["exit"])
                    break
        self._conn.close()
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"warm launch {self.pid}", timeout or 0)
        return int(self.returncode or 0)


def _hello(conn: socket.socket) -> dict[str, Any]:
    line = b""
    while not line.endswith(b"\n"):
        more = conn.recv(65536)
        if not more:
            raise ConnectionError("the standby hung up")
        line += more
    return dict(json.loads(line))


def _connect(run: str, node: int) -> tuple[socket.socket, dict[str, Any]] | None:
    try:
        path = socket_path(run, node)
    except OSError as exc:
        log.warning("%s node %d: %s", run, node, exc)
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        conn.connect(str(path))
        return conn, _hello(conn)
    except (OSError, ValueError):
        conn.close()
        return None


def handoff(
    run: str, node: int, command: Sequence[str], cwd: str | None, env: Mapping[str, str], out: int
) -> Handed | None:
    """Hand this launch to the node's standby (its output to ``out``); None when there is none fit for it
    (then a stale one is told to quit)."""
    found = _connect(run, node)
    if found is None:
        return None
    conn, hello = found
    if hello.get("command") != list(command) or hello.get("env") != env_digest(env):
        what = "command" if hello.get("command") != list(command) else "environment"
        log.info("%s node %d: the standby was made for another %s; this launch starts cold", run, node, what)
        _quit(conn)
        return None
    try:
        message = json.dumps({"command": list(command), "cwd": cwd, "env": dict(env)}).encode() + b"\n"
        socket.send_fds(conn, [message], [out])
        conn.settimeout(30.0)
        reply = _hello(conn)
        conn.settimeout(None)
        return Handed(conn, int(reply["pid"]))
    except (OSError, ValueError, KeyError):
        conn.close()
        return None


def ready(run: str, node: int, command: Sequence[str], env: Mapping[str, str]) -> bool:
    """Is a standby for this command and environment answering now?"""
    found = _connect(run, node)
    if found is None:
        return False
    conn, hello = found
    fit = hello.get("command") == list(command) and hello.get("env") == env_digest(env)
    if not fit:
        _quit(conn)
    else:
        conn.close()
    return fit


def _quit(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"quit": True}).encode() + b"\n")
    conn.close()


def stop(run: str, node: int) -> None:
    """The node's standbys quit (its run finished): the one answering is told so, one still importing sees
    the stop mark before it listens, one busy with the last launch finds its socket gone after it."""
    try:
        path = socket_path(run, node)
        stop_mark(path).touch()
    except OSError as exc:
        log.warning("%s node %d: its standbys not told to quit: %s", run, node, exc)
        return
    found = _connect(run, node)
    if found is not None:
        _quit(found[0])
    path.unlink(missing_ok=True)


def answering(run: str, node: int) -> bool:
    """Is any standby of ``run``'s node answering now (whatever it was started for)?"""
    found = _connect(run, node)
    if found is not None:
        found[0].close()
    return found is not None


def wait_ready(run: str, node: int, command: Sequence[str], env: Mapping[str, str], timeout_s: float) -> bool:
    """Wait (bounded) until a fit standby answers: for tests and benchmarks that need one in place."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready(run, node, command, env):
            return True
        time.sleep(0.1)
    return False


def replace_standby(
    run: str, node: int, cmd: list[str], cwd: str | None, env: dict[str, str], used: bool
) -> None:
    """A standby for the node's next launch: a new one when the one there was just used (it is busy with
    this launch) or none fit answers; never the job's problem if it cannot be made."""
    try:
        if used or not ready(run, node, cmd, env):
            start(run, node, cmd, cwd, env)
    except Exception as exc:
        log.warning("no standby for %s node %d (its next launch starts cold): %s", run, node, exc)
