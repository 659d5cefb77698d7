"""One node's process of a launch, as the supervisor watches it: started cold as a child in a session of
its own, or handed to the node's standby (warm relaunch); its exit, and its output's tail kept for the
incident (the whole output kept per node by ``joblog``)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from rewind.infra import joblog, redact
from rewind.infra.launch import warm

log = logging.getLogger("rewind.supervisor")

TAIL_LINES = 20  # the job's last lines kept for the flow log, the incident and the failure event
TAIL_BYTES = 4096  # ... and no more than this many bytes of them (UTF-8)
_READ_CHUNK = 8192  # a line longer than this is kept in pieces: one endless line cannot fill memory
_KEPT_LINE_MAX = 1 << 20  # ... and written to the kept output in pieces of at most this


def bounded_tail(lines: list[str], max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The newest ``lines`` that fit ``max_lines`` and ``max_bytes`` (a longer last line keeps its end),
    with any URL's user:password hidden."""
    out: list[str] = []
    used = 0
    for line in reversed(lines[-max_lines:]):
        line = redact.text(line)
        size = len(line.encode()) + 1
        if used + size > max_bytes:
            if not out:  # the newest line alone is too long: keep its end
                out.append("..." + line.encode()[-(max_bytes - 4) :].decode(errors="ignore"))
            break
        out.append(line)
        used += size
    return out[::-1]


def _kept_log(path: Path | None) -> joblog.NodeLog | None:
    if path is None:
        return None
    try:
        return joblog.NodeLog(path)
    except OSError as exc:
        log.warning("the job's output cannot be kept in %s: %s", path, exc)
        return None


class NodeProcess:
    """One child process (a job, or a node's agent) in its own session, its output's tail kept for the incident."""

    def __init__(
        self,
        cmd: list[str],
        *,
        cwd: str | None,
        env: dict[str, str],
        node: int,
        host: str,
        kept: Path | None,
        warm_run: str | None = None,
    ) -> None:
        self.node, self.cmd, self.host = node, cmd, host
        self.ended_at: float | None = None  # when it ended, by this clock: which node failed first
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc: subprocess.Popen[str] | warm.Handed
        self.output: IO[str]
        self.warm = warm_run is not None and self._hand_over(warm_run, cwd, env)
        if not self.warm:
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1, start_new_session=True,
            )  # fmt: skip
            assert self.proc.stdout is not None
            self.output = self.proc.stdout
        self.log = _kept_log(kept)  # once the process exists: nothing is opened for a command that is not
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"rewind-out-{self.proc.pid}")
        self._reader.start()
        threading.Thread(target=self._wait, daemon=True, name=f"rewind-wait-{self.proc.pid}").start()

    def _hand_over(self, run: str, cwd: str | None, env: dict[str, str]) -> bool:
        """The launch to the node's standby, its output through a pipe of ours; False: start it cold."""
        read_end, write_end = os.pipe()
        try:
            # no cwd in the spec: this supervisor's, as a cold start has, not the standby's
            handed = warm.handoff(run, self.node, self.cmd, cwd or os.getcwd(), env, write_end)
        finally:
            os.close(write_end)  # the job holds its own copy: the pipe ends when the job does
        if handed is None:
            os.close(read_end)
            return False
        self.proc = handed
        self.output = os.fdopen(read_end, "r", errors="replace", buffering=1)
        return True

    def _read(self) -> None:
        out = self.output
        # children that outlive it may keep the pipe open: not our clock
        pending = ""  # a line longer than a chunk, kept whole (to a bound) so its masking sees all of it
        for chunk in iter(lambda: out.readline(_READ_CHUNK), ""):
            self.tail.append(chunk.rstrip("\n"))
            pending += chunk
            if chunk.endswith("\n") or len(pending) >= _KEPT_LINE_MAX:
                self._keep(pending)
                pending = ""
        if pending:
            self._keep(pending)
        if self.log is not None:
            self.log.close()

    def _keep(self, line: str) -> None:
        if self.log is None:
            return
        try:
            self.log.write(line)
        except OSError as exc:  # a full disk stops the copy, never the job or its watch
            log.warning("the job's output is no longer kept in %s: %s", self.log.path, exc)
            with contextlib.suppress(OSError):
                self.log.close()
            self.log = None

    def _wait(self) -> None:
        self.proc.wait()
        self.ended_at = time.time()

    def joined(self, timeout_s: float = 5.0) -> None:
        """Let the output reader finish (bounded: workers that outlive the agent may hold the pipe)."""
        self._reader.join(timeout=timeout_s)

    def ended(self) -> int | None:
        """The exit code once the process has ended, else None."""
        return self.proc.returncode if self.ended_at is not None else None
