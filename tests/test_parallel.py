"""``parallel.run_all``: results in call order (a call's ``None`` kept), a few calls at a time; after a
failure no further call starts, and the first failure in call order is raised only once every call started
has ended."""

from __future__ import annotations

import threading

import pytest

from rewind.infra import parallel


def test_results_come_back_in_call_order_none_included_at_most_workers_at_once():
    lock = threading.Lock()
    running = [0]
    most = [0]
    both = threading.Barrier(2, timeout=10)  # two calls must overlap: the first two meet here

    def call(i: int) -> int | None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if i < 2:
            both.wait()
        with lock:
            running[0] -= 1
        return None if i == 3 else i * i

    calls = [lambda i=i: call(i) for i in range(9)]
    assert parallel.run_all(calls, workers=2, name="t") == [0, 1, 4, None, 16, 25, 36, 49, 64]
    assert most[0] == 2


def test_the_first_failure_in_order_is_raised_after_every_started_call_ended_and_none_starts_after():
    started: list[int] = []
    ended: list[int] = []
    slow_may_end = threading.Event()
    lock = threading.Lock()

    def call(i: int) -> int:
        with lock:
            started.append(i)
        try:
            if i == 0:  # still running when call 1 fails: the failure waits for it
                assert slow_may_end.wait(10)
                raise ValueError("zero")
            if i == 1:
                slow_may_end.set()
                raise KeyError("one")
            return i
        finally:
            with lock:
                ended.append(i)

    with pytest.raises(ValueError, match="zero"):  # call 0's, though call 1 failed first
        parallel.run_all([lambda i=i: call(i) for i in range(6)], workers=2, name="t")
    assert sorted(started) == sorted(ended) == [0, 1]  # nothing left running, nothing started after
