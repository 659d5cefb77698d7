"""A standby interpreter for warm relaunches: the job's imports done, waiting to run a relaunch at once.

    python -m rewind.infra.launch.standby SOCKET -- python -m pkg.train ARG...   (or: python train.py ARG...)

It imports torch and every module the job's entry file imports at its top level (the file is read, never
run: a ``-m`` module's code, or a script's, runs only when a launch is handed over), then listens on a Unix
socket (0600). A supervisor connecting is told what this standby was started for (its command and the
digest of its environment, per-launch variables left out), and may hand it a launch: the command's
arguments, working directory and whole environment, and the file descriptor its output goes to
(``SCM_RIGHTS``). The standby forks; the child becomes the job (its own session, that output, that
environment, the entry run as ``__main__``) and the standby reports the child's pid, then its exit
status. The fork keeps every import: a relaunch skips the interpreter's start and torch's import. The
standby serves one launch at a time and outlives each (a zygote); it exits when told to, when idle past
``REWIND_STANDBY_IDLE_S`` (default 1800), when its socket is gone, or, refusing the launch, when a source
file of the job's it imported was edited since (a fixed bug must not come back from its old copy). Nothing here computes with torch
before a fork: no thread pool, no CUDA context is made in the standby.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import random
import runpy
import signal
import socket
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

IDLE_ENV = "REWIND_STANDBY_IDLE_S"
# What differs from one launch of a run to the next: left out of the standby's environment check.
PER_LAUNCH = frozenset({
    "REWIND_LAUNCH_ID", "REWIND_LAUNCH_TOKEN", "REWIND_NODE", "REWIND_LR_SCALE", "REWIND_GLOBAL_BATCH",
    "REWIND_LAYOUT", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
})  # fmt: skip
MAX_MESSAGE = 1 << 20
LAZY = ("torch._dynamo", "torch.distributed.checkpoint")  # imported by torch on first use, not at import


def env_digest(env: Mapping[str, str]) -> str:
    """What must match between a standby's environment and a launch's (variables read at import time);
    the orchestrator's own (``PREFECT_*``, one flow run's, another's) are not the job's."""
    kept = sorted((k, v) for k, v in env.items() if k not in PER_LAUNCH and not k.startswith("PREFECT_"))
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


def entry_of(command: Sequence[str]) -> tuple[str, str] | None:
    """``("module", name)`` for ``python -m name ...``, ``("script", path)`` for ``python path ...``; None for
    anything a standby cannot take over (interpreter options, ``-c``, no Python)."""
    if len(command) < 2 or not Path(command[0]).name.startswith("python"):
        return None
    if command[1] == "-m" and len(command) > 2:
        return "module", command[2]
    if command[1].startswith("-"):
        return None
    return "script", command[1]


def _entry_file(kind: str, name: str) -> Path | None:
    if kind == "script":
        return Path(name)
    spec = importlib.util.find_spec(name)  # imports the parent packages, as `python -m` would
    if spec is not None and spec.submodule_search_locations:  # a package: its __main__
        spec = importlib.util.find_spec(f"{name}.__main__")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _imports_of(path: Path, package: str | None) -> list[str]:
    """The modules a file imports at its top level (``try`` blocks included), absolute names."""
    tree = ast.parse(path.read_bytes(), str(path))
    names: list[str] = []
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.Try):
            body[:0] = node.body
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level and package:
            base = package.rsplit(".", node.level - 1)[0]
            names.append(f"{base}.{node.module}" if node.module else base)
    return names


def prepare(command: Sequence[str]) -> list[str]:
    """Import torch and what the entry imports; the modules that failed to import (left to the job).
    A module that asks ``torch.cuda.is_available()`` at import is answered through NVML, without a CUDA
    context (one made before a fork is unusable in the child): ``PYTORCH_NVML_BASED_CUDA_CHECK``."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import torch  # noqa: F401  (the import a relaunch is spared)

    for lazy in LAZY:  # what torch imports on first use (an optimizer's first construction: ~0.7 s)
        with contextlib.suppress(Exception):
            importlib.import_module(lazy)

    kind, name = entry_of(command) or ("", "")
    if kind == "script":  # as `python script.py` would: its directory first on the path
        sys.path.insert(0, str(Path(name).resolve().parent))
    path = _entry_file(kind, name) if kind else None
    package = name.rpartition(".")[0] or None if kind == "module" else None
    failed = []
    for module in _imports_of(path, package) if path is not None else []:
        try:
            importlib.import_module(module)
        except Exception:  # the job imports it again, and fails there in its own words if it must
            failed.append(module)
    _remember_sources()
    return failed


def _cuda_made() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


_IMPORTED: dict[str, int] = {}  # the job's own source files the standby imported -> their mtime then


def _remember_sources() -> None:
    """The files of every module imported that is not Python's own or an installed package's."""
    installed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or any(os.path.realpath(path).startswith(p + os.sep) for p in installed):
            continue
        with contextlib.suppress(OSError):
            _IMPORTED[path] = os.stat(path).st_mtime_ns


def changed_since_import() -> list[str]:
    """The job's source files edited (or gone) since the standby imported them."""
    out = []
    for path, mtime in _IMPORTED.items():
        try:
            if os.stat(path).st_mtime_ns != mtime:
                out.append(path)
        except OSError:
            out.append(path)
    return out


def _run(command: Sequence[str]) -> int:
    """The job itself, in the forked child: its entry as ``__main__``; the exit code."""
    kind, name = entry_of(command) or ("", "")
    try:
        if kind == "module":
            sys.argv = [name, *command[3:]]
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command[1:])
            if sys.path[:1] != [str(Path(name).resolve().parent)]:
                sys.path.insert(0, str(Path(name).resolve().parent))
            runpy.run_path(name, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _die_with(parent: int) -> None:
    """The job ends if its standby does (Linux ``PR_SET_PDEATHSIG``): the supervisor hears of both together,
    and no job runs on unwatched beside the relaunch."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the standby died before the request took hold
        os._exit(137)


def _become_job(launch: dict[str, Any], out: int, closing: list[socket.socket], standby: int) -> None:
    """The forked child: a session of its own, the launch's output, directory and environment; never returns."""
    code = 1
    try:
        for sock in closing:  # the listener and the supervisor's connection are the standby's, not the job's
            sock.close()
        _die_with(standby)
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        if launch.get("cwd"):
            os.chdir(launch["cwd"])
        os.environ.clear()
        os.environ.update(launch["env"])
        _reseed()
        code = _run(launch["command"])
        _shutdown()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reseed() -> None:
    """Fresh seeds per launch, as a new interpreter would draw them (Python's, and NumPy's global one)."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


def _shutdown() -> None:
    """What an interpreter does at its end: wait for the job's non-daemon threads (an async save finishing),
    then run its exit handlers."""
    import atexit
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One launch: its JSON line and the descriptors sent with it."""
    data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 4)
    while not data.endswith(b"\n"):
        more = conn.recv(MAX_MESSAGE)
        if not more:
            raise ConnectionError("the supervisor hung up mid-message")
        data += more
    return json.loads(data), list(fds)


def _serve_one(conn: socket.socket, listener: socket.socket, hello: dict[str, Any]) -> bool:
    """One supervisor's visit: a launch run to its end, a ``quit`` (False), or nothing."""
    _send(conn, hello)
    try:
        launch, fds = _receive(conn)
    except (ConnectionError, ValueError, OSError):
        return True
    if launch.get("quit"):
        return False
    if len(fds) != 1 or launch.get("command") != hello["command"]:  # only what it was made for
        for fd in fds:
            os.close(fd)
        return True
    if changed_since_import():  # the job's code was edited: a new interpreter must read it
        os.close(fds[0])
        return False
    standby = os.getpid()
    pid = os.fork()
    if pid == 0:
        _become_job(launch, fds[0], [listener, conn], standby)
    os.close(fds[0])
    with contextlib.suppress(OSError):
        _send(conn, {"pid": pid})
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
    return True


def stop_mark(path: Path) -> Path:
    """Beside a standby's socket: its run finished, a standby still starting must not listen."""
    return path.with_name(path.name + ".stop")


def serve(path: Path, command: Sequence[str]) -> int:
    started_with = env_digest(os.environ)  # before any import: some set variables of their own
    failed = prepare(command)
    if stop_mark(path).exists():
        return 0
    if _cuda_made():
        print("the job's imports made a CUDA context: a fork could not use it; no standby", file=sys.stderr)
        return 3
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    listener.bind(str(tmp))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)  # ready, all at once
    mine = os.stat(path).st_ino
    listener.listen(4)
    listener.settimeout(float(os.environ.get(IDLE_ENV) or 1800))
    hello = {"pid": os.getpid(), "command": list(command), "env": started_with, "failed": failed}
    try:
        while _still(path, mine):
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return 0  # idle past its time: nobody needs it
            with conn:
                if not _serve_one(conn, listener, hello):
                    return 0
    finally:
        listener.close()
        if _still(path, mine):  # a newer standby's socket under the same name is left alone
            path.unlink(missing_ok=True)
    return 0


def _still(path: Path, inode: int) -> bool:
    """Is the socket at ``path`` still this standby's?"""
    try:
        return os.stat(path).st_ino == inode
    except FileNotFoundError:
        return False


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m rewind.infra.launch.standby SOCKET -- COMMAND...", file=sys.stderr)
        return 2
    if entry_of(argv[2:]) is None:
        print(
            f"a standby runs only `python -m MODULE` or `python SCRIPT` commands, not {argv[2:]}",
            file=sys.stderr,
        )
        return 2
    return serve(Path(argv[0]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
