"""Calls run a few at a time on daemon threads of their own: a save's file writes, a chunked save's hashing.

Not a ``ThreadPoolExecutor``: a pool refuses new work once the interpreter starts to exit, and then waits
on the work it holds without bound, so a background save still in flight when a script ends would fail.
Daemon threads started by the persist thread inherit its CPU priority, and an exit does not wait on them.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def run_all(calls: Sequence[Callable[[], T]], *, workers: int, name: str) -> list[T]:
    """Each of ``calls``, ``workers`` at a time (each thread with a copy of the caller's context); their
    results in order. After a failure no further call starts; the failure of the first call in order that
    failed is raised once every call started has ended (nothing is left running), as is anything raised in
    the calling thread while it waits (an interrupt)."""
    if len(calls) <= 1 or workers <= 1:
        return [call() for call in calls]
    done: list[tuple[T] | None] = [None] * len(calls)
    failed: dict[int, BaseException] = {}
    stopped = threading.Event()
    lock = threading.Lock()
    todo = iter(range(len(calls)))

    def work() -> None:
        while True:
            with lock:
                i = None if failed or stopped.is_set() else next(todo, None)
            if i is None:
                return
            try:
                done[i] = (calls[i](),)
            except BaseException as exc:  # raised by the thread that waits on them all
                with lock:
                    failed[i] = exc

    _run(work, min(workers, len(calls)), name, stopped)
    if failed:
        raise failed[min(failed)]
    if any(d is None for d in done):
        raise RuntimeError(f"{name}: a call neither returned nor failed")
    return [d[0] for d in done if d is not None]


def _run(work: Callable[[], None], threads: int, name: str, stopped: threading.Event) -> None:
    """``work`` on ``threads`` daemon threads, waited for; if the wait itself is interrupted, no further call
    starts and the threads started are waited for before the interrupt goes on."""
    started: list[threading.Thread] = []
    try:
        for _ in range(threads):
            t = threading.Thread(target=contextvars.copy_context().run, args=(work,), name=name, daemon=True)
            t.start()
            started.append(t)
        for t in started:
            t.join()
    except BaseException:
        stopped.set()
        for t in started:
            t.join()
        raise
