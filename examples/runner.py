"""Run an example as a child process and read its output line by line (for the tests and the demo).

The examples print ``step=<i> loss=<x>`` and ``resumed run NAME at step N``: this
parses those lines, so a test can compare losses with an uninterrupted run. Rewind
itself never reads a job's output: the supervisor learns progress from the ranks'
reports (``rewind.infra.training.progress``).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STEP_LINE = re.compile(r"^step=(\d+) loss=(\S+)$")
RESUMED_LINE = re.compile(r"resumed run \S+ at step (\d+)")


@dataclass
class Output:
    lines: list[str] = field(default_factory=list)

    @property
    def losses(self) -> dict[int, str]:
        return {int(m.group(1)): m.group(2) for line in self.lines if (m := STEP_LINE.match(line))}

    @property
    def last_step(self) -> int | None:
        return max(self.losses, default=None)

    @property
    def resumed_at(self) -> int | None:
        for line in self.lines:
            if m := RESUMED_LINE.search(line):
                return int(m.group(1))
        return None

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class TrainingProcess:
    """One child process; stdout and stderr merged."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.cmd = list(cmd)
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self.output = Output()
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True, name=f"pump-{self.proc.pid}").start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        if self.proc.stdout is None:
            return
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, pred: Callable[[str], bool], timeout: float) -> bool:
        """Consume lines until one satisfies ``pred``; False when the output ends first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.cmd[:4]}: no expected line within {timeout:.0f}s")
            try:
                line = self._q.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                self._q.put(None)  # stay at end-of-output for later waits
                return False
            self.output.lines.append(line)
            if pred(line):
                return True

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.finish(timeout)

    def finish(self, timeout: float = 600) -> int:
        """Read to the end of output and reap the process; returns its exit code (-N for signal N)."""
        self.wait_for(lambda _line: False, timeout)
        return self.proc.wait(timeout=30)
