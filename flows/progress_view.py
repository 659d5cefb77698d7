"""Progress of long CLI work on stderr: a byte bar on a terminal, plain periodic lines otherwise.

rich draws the bar (Prefect already depends on it, so it costs no new dependency); a log
file or a CI console gets one line when a phase starts, one per tenth of it or per
``LINE_EVERY_S`` (whichever comes first), and one when it ends. A phase under ``MIN_SHOWN_BYTES``
is not shown: it is over before anyone could read it. stdout stays for results (``--json`` output is
never mixed with progress).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Column

from rewind.infra import progress, sizes

LINE_EVERY_S = 10.0
MIN_SHOWN_BYTES = 32 << 20  # a phase smaller than this is done before a person could read a bar of it


class BarMeter:
    """One rich bar per phase, bytes done, speed and time left."""

    def __init__(self, stream: TextIO, min_bytes: int = MIN_SHOWN_BYTES) -> None:
        self._min = min_bytes
        self._bars = Progress(
            TextColumn(
                "{task.description}", table_column=Column(max_width=60, no_wrap=True, overflow="ellipsis")
            ),
            BarColumn(bar_width=30),
            DownloadColumn(binary_units=True, table_column=Column(no_wrap=True)),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(file=stream),
        )
        self._task: TaskID | None = None

    def begin(self, what: str, total: int) -> None:
        self._task = self._bars.add_task(what, total=total) if total >= self._min else None

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._bars.advance(self._task, nbytes)  # rich takes its own lock

    def end(self) -> None:
        self._task = None

    def __enter__(self) -> BarMeter:
        self._bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bars.stop()


class LineMeter:
    """Plain lines for logs: start, every tenth or ``every_s`` seconds, end (with the rate)."""

    def __init__(
        self, stream: TextIO, every_s: float = LINE_EVERY_S, min_bytes: int = MIN_SHOWN_BYTES
    ) -> None:
        self._out, self._every, self._min = stream, every_s, min_bytes
        self._lock = threading.Lock()
        self._what, self._total, self._done = "", 0, 0
        self._started = self._last_at = 0.0
        self._last_tenth = 0

    def _line(self, note: str = "") -> None:
        pct = f" {100 * self._done / self._total:5.1f}%" if self._total else ""
        print(
            f"{self._what}:{pct} {sizes.human(self._done)} of {sizes.human(self._total)}{note}",
            file=self._out,
            flush=True,
        )

    def begin(self, what: str, total: int) -> None:
        with self._lock:
            self._what, self._total, self._done, self._last_tenth = "", total, 0, 0
            if total < self._min:
                return  # too small to be worth a line: not shown at all
            self._what = what
            self._started = self._last_at = time.monotonic()
            self._line()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            if not self._what:
                return  # bytes outside any phase: nothing to show them against
            self._done += nbytes
            tenth = 10 * self._done // self._total if self._total else 0
            now = time.monotonic()
            if tenth > self._last_tenth or now - self._last_at >= self._every:
                self._last_tenth, self._last_at = tenth, now
                if self._done < self._total:
                    self._line()

    def end(self) -> None:
        with self._lock:
            if not self._what:
                return
            took = time.monotonic() - self._started
            self._line(f", done in {took:.1f}s ({sizes.human(self._done / took if took > 0 else 0)}/s)")
            self._what = ""

    def __enter__(self) -> LineMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def shown(stream: TextIO | None = None) -> Iterator[None]:
    """Show the progress of the long work inside the block on ``stream`` (stderr by default)."""
    out = stream or sys.stderr
    with BarMeter(out) if out.isatty() else LineMeter(out) as meter, progress.watching(meter):
        yield
