"""Run ``examples.tiny_lm`` as a real subprocess and read what it prints."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step=(\d+) loss=(\S+)$")
RESUMED = re.compile(r"resumed run \S+ at step (\d+)")


@dataclass
class Output:
    lines: list[str] = field(default_factory=list)

    @property
    def losses(self) -> dict[int, str]:
        return {int(m.group(1)): m.group(2) for line in self.lines if (m := STEP.match(line))}

    @property
    def resumed_at(self) -> int | None:
        for line in self.lines:
            if m := RESUMED.search(line):
                return int(m.group(1))
        return None

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class TrainProc:
    """One training process; stdout and stderr merged, read on a thread so waits are bounded."""

    def __init__(
        self,
        run: str,
        out: Path,
        *,
        steps: int = 60,
        every: int = 10,
        seed: int = 0,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "examples.tiny_lm",
            "--run",
            run,
            "--steps",
            str(steps),
            "--checkpoint-every",
            str(every),
            "--seed",
            str(seed),
            "--out",
            str(out),
            *(extra or []),
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.output = Output()
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, pred: Callable[[str], bool], timeout: float = 120) -> bool:
        """Read lines until one satisfies ``pred``; False if the process ended first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching line within {timeout}s; got:\n{self.output.text[-2000:]}")
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                return False
            self.output.lines.append(line)
            if pred(line):
                return True

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.finish()

    def finish(self, timeout: float = 180) -> Output:
        self.wait_for(lambda _l: False, timeout)
        self.proc.wait(timeout=30)
        return self.output


def run_to_end(run: str, out: Path, **kw) -> tuple[int, Output]:  # type: ignore[no-untyped-def]
    p = TrainProc(run, out, **kw)
    o = p.finish()
    return p.proc.returncode, o


def assert_same_weights(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"tensor {k} differs"
