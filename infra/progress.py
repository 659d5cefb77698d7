"""Byte progress of long work (replicate, restore, deep verify, gc): reported here, drawn elsewhere.

infra never draws. Long work opens a *phase* (what, total bytes) and advances it as bytes
are hashed, sent, fetched or freed; whoever watches is chosen by the caller for the
current context with ``watching(meter)``: the CLI draws a terminal bar or plain lines
(``flows/progress_view.py``), a Prefect task keeps a progress artifact up to date
(``tasks/progress.py``). With nobody watching, a report costs one context-variable
lookup per chunk (8 MiB), so the hot paths report unconditionally.

Worker threads do not inherit the context: code that fans out captures ``current()``
first and advances that meter from its threads (every ``Meter`` is thread-safe).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Protocol


class Meter(Protocol):
    def begin(self, what: str, total: int) -> None:
        """A new phase of ``total`` bytes starts (the previous one, if any, has ended)."""
        ...

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the current phase are done; safe to call from any thread."""
        ...

    def end(self) -> None:
        """The current phase is over, complete or not."""
        ...


_watcher: ContextVar[Meter | None] = ContextVar("rewind_progress", default=None)
_silenced: weakref.WeakSet[Meter] = weakref.WeakSet()
log = logging.getLogger("rewind.progress")


def current() -> Meter | None:
    """The meter watching this context, guarded, to hand to worker threads (None: nobody watches)."""
    meter = _watcher.get()
    return None if meter is None else guarded(meter)


@contextlib.contextmanager
def watching(meter: Meter) -> Iterator[Meter]:
    """Report the progress of everything run inside the block to ``meter``."""
    token = _watcher.set(meter)
    try:
        yield meter
    finally:
        _watcher.reset(token)


def _report(meter: Meter, call: Callable[[], None]) -> None:
    """Showing progress must never fail the work: a meter that raises (a closed stderr, an API error) is
    silenced for the rest of the block instead."""
    if meter in _silenced:
        return
    try:
        call()
    except Exception as exc:
        _silenced.add(meter)
        log.warning("progress no longer shown: %s", exc)


@contextlib.contextmanager
def phase(what: str, total: int) -> Iterator[None]:
    """One stretch of byte work, shown as one bar or one series of lines (nothing to show for 0 bytes)."""
    meter = _watcher.get()
    if meter is None or total <= 0:
        yield
        return
    _report(meter, lambda: meter.begin(what, total))
    try:
        yield
    finally:
        _report(meter, meter.end)


def advance(nbytes: int) -> None:
    """``nbytes`` of the current phase are done (hashed, written, sent, freed)."""
    meter = _watcher.get()
    if meter is not None and nbytes > 0:
        _report(meter, lambda: meter.advance(nbytes))


def guarded(meter: Meter) -> Meter:
    """``meter`` for code that calls it directly from worker threads (S3 parts), with the same guard."""
    return _Guarded(meter)


class _Guarded:
    def __init__(self, meter: Meter) -> None:
        self._meter = meter

    def begin(self, what: str, total: int) -> None:
        _report(self._meter, lambda: self._meter.begin(what, total))

    def advance(self, nbytes: int) -> None:
        _report(self._meter, lambda: self._meter.advance(nbytes))

    def end(self) -> None:
        _report(self._meter, self._meter.end)


class Tally:
    """Counts the bytes advanced in a block (hashed, fetched: for a restore, every byte read of the
    restore point), passing every report on to whoever watched the block's context before."""

    def __init__(self, inner: Meter | None) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.bytes = 0

    def begin(self, what: str, total: int) -> None:
        if self._inner is not None:
            self._inner.begin(what, total)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
        if self._inner is not None:
            self._inner.advance(nbytes)

    def end(self) -> None:
        if self._inner is not None:
            self._inner.end()


@contextlib.contextmanager
def tallied() -> Iterator[Tally]:
    """Count the bytes of the work run inside the block; what was shown before is still shown."""
    tally = Tally(current())
    with watching(tally):
        yield tally
