"""Process control shared by every layer: find processes, stop a process group, find a program."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from rewind.infra.errors import ConfigError


def find_pids(*needles: str) -> list[int]:
    """Processes whose command line contains every needle (e.g. a job a flow started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def pids_with_env(**env: str) -> list[int]:
    """Processes (of this user) whose environment holds every ``NAME=value`` given.

    torchrun starts its workers in sessions of their own, so a launch's processes are
    found by the variables the supervisor gave them, which every descendant inherits.
    """
    wanted = {f"{k}={v}".encode() for k, v in env.items()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            variables = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= variables:
            found.append(int(entry.name))
    return found


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to every pid that still exists (and SIGCONT after a SIGTERM, for stopped ones)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            if sig == signal.SIGTERM:
                os.kill(pid, signal.SIGCONT)


def is_running(pid: int, needle: str) -> bool:
    """Is ``pid`` alive and still the program we think (its command line holds ``needle``)?

    A pid read from a file may belong to an unrelated process after a reboot or a crash.
    """
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return needle in cmdline


def stop_group(pid: int, *, timeout_s: float = 20) -> None:
    """SIGTERM a process group started with ``start_new_session``; SIGKILL it after a bounded wait.

    Works for a group this process did not start (a server started by an earlier CLI call).
    """
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(
                    pid, signal.SIGCONT
                )  # a stopped (SIGSTOP'd, hung) process handles it only once running
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap our own child, or it lingers as a zombie
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def program(name: str, install_hint: str) -> str:
    """Path of an executable on PATH or beside this Python (a venv's console scripts); ConfigError if absent."""
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(found).exists():
        raise ConfigError(f"{name} is not installed: {install_hint}")
    return found
