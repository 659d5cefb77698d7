"""The supervisor's handle on its node's memory agent (``infra/memory/agent.py``): started with the launch,
told of each checkpoint committed, closed when the launch ends. A memory agent that cannot start or dies
never fails the job: the memory tier is an extra copy, the disk's is the one counted on."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from typing import IO

from rewind.infra.errors import ConfigError
from rewind.infra.memory import place

log = logging.getLogger("rewind.supervisor")
CLOSE_S = 60.0  # a copy in progress is let finish this long when the launch ends


class MemoryAgent:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    @classmethod
    def start(cls, run: str, env: dict[str, str]) -> MemoryAgent | None:
        """The agent for ``run`` on this node; None when the memory tier is off (or cannot be had)."""
        try:
            if place.config() is None:
                return None
        except ConfigError as exc:
            log.warning("memory tier off: %s", exc)
            return None
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rewind.infra.memory.agent", run],
                stdin=subprocess.PIPE, env=env, text=True, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            log.warning("memory agent not started: %s", exc)
            return None
        return cls(proc)

    def _say(self, line: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(line + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:  # said once: its stdin is closed after
            log.warning("memory agent gone (exit %s): %s; no more copies into memory", self.proc.poll(), exc)
            with contextlib.suppress(OSError, ValueError):
                stdin.close()

    def offer(self, checkpoint_id: int) -> None:
        self._say(str(checkpoint_id))

    def close(self, *, release: bool) -> None:
        """It ends once its copy in progress is done. ``release`` (the run finished): the run's memory copies
        let go first, waited for; otherwise (a failure) not waited for: the recovery must not wait on it."""
        if release:
            self._say("release")
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if not release:
            return
        try:
            self.proc.wait(timeout=CLOSE_S)
        except subprocess.TimeoutExpired:
            log.warning("memory agent still copying after %.0f s: stopped", CLOSE_S)
            self.proc.kill()
            self.proc.wait()
