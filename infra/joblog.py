"""The job's own output, kept: every launch's stdout and stderr, per node, under ``$REWIND_HOME/logs``.

``logs/<run>/launch-<id>/node-<n>.log`` holds what node ``n``'s process printed (a torchrun agent
prints its ranks' lines, each prefixed with its rank). Each file is bounded: past ``max_bytes`` it
is rotated to ``.1`` (the one before is dropped), so a launch keeps at most twice that per node,
and a run the newest ``KEEP_LAUNCHES`` launches.
Any URL's ``user:password`` is masked before a line is written, as in the incident's tail.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rewind.infra import config, redact
from rewind.infra.errors import ConfigError

MAX_BYTES = 64 << 20  # per node and file; REWIND_JOB_LOG_MAX_MB changes it
_LAUNCH = re.compile(r"launch-(\d+)$")
_NODE = re.compile(r"node-(\d+)\.log$")


MIN_BYTES = 4096
KEEP_LAUNCHES = 20  # per run: the output of older launches is removed when a new one starts


def max_bytes() -> int:
    """The bound of one file (REWIND_JOB_LOG_MAX_MB, MiB, default 64); a bad value is a ``ConfigError``."""
    raw = os.environ.get("REWIND_JOB_LOG_MAX_MB", "").strip()
    if not raw:
        return MAX_BYTES
    try:
        mib = float(raw)
    except ValueError:
        mib = math.nan
    if not math.isfinite(mib) or mib <= 0:
        raise ConfigError(f"REWIND_JOB_LOG_MAX_MB must be a positive number of MiB, not {raw!r:.40}")
    return max(MIN_BYTES, int(mib * (1 << 20)))


run_dir = config.job_logs
launch_dir = config.job_log_dir


class NodeLog:
    """One node's output file: lines appended as they come (masked), rotated past ``limit`` bytes."""

    def __init__(self, path: Path, limit: int | None = None) -> None:
        self.path, self.limit = path, limit if limit is not None else max_bytes()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out: IO[str] = self._open()
        self._size = self.path.stat().st_size

    def _open(self) -> IO[str]:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # output may hold secrets
        return os.fdopen(fd, "w", encoding="utf-8", errors="replace", buffering=1)

    def write(self, line: str) -> None:
        text = redact.text(line.rstrip("\n")) + "\n"
        size = len(text.encode("utf-8", errors="replace"))
        if self._size and self._size + size > self.limit:
            self._rotate()
        self._out.write(text)
        self._size += size

    def _rotate(self) -> None:
        self._out.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._out, self._size = self._open(), 0

    def close(self) -> None:
        self._out.close()


@dataclass(frozen=True)
class LaunchLogs:
    """The kept output of one launch: its directory and one file per node."""

    run: str
    launch_id: int
    path: Path

    def nodes(self) -> list[tuple[int, Path]]:
        found = [(int(m.group(1)), p) for p in self.path.iterdir() if (m := _NODE.search(p.name))]
        return sorted(found)


def kept(run: str) -> list[LaunchLogs]:
    """Every launch of ``run`` whose output is kept here, oldest first."""
    where = run_dir(run)
    if not where.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in where.iterdir() if (m := _LAUNCH.search(p.name)) and p.is_dir()]
    return [LaunchLogs(run, n, p) for n, p in sorted(found)]


def lines(path: Path) -> Iterator[str]:
    """A node's kept lines, the rotated part first."""
    for part in (path.with_name(path.name + ".1"), path):
        if part.is_file():
            with open(part, encoding="utf-8", errors="replace") as f:
                yield from (line.rstrip("\n") for line in f)


def prune(run: str, keep: int = KEEP_LAUNCHES) -> None:
    """Remove the kept output of all but the newest ``keep`` launches of ``run`` (a run's logs stay bounded)."""
    for old in kept(run)[:-keep] if keep > 0 else kept(run):
        shutil.rmtree(old.path, ignore_errors=True)
