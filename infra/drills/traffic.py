"""Client traffic through a serving proxy: concurrent requests, each recorded with who answered it.

What a serving drill (and the serving tests) measure a fault by: every request's start and end, its HTTP
status (0 when no answer came at all), and the version and instance the proxy says answered it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True, slots=True)
class Sample:
    started: float  # epoch seconds
    ended: float
    status: int  # 0: no HTTP answer at all
    version: str | None
    instance: str | None = None  # which TorchServe instance answered (the proxy's x-rewind-instance)


@dataclass
class Load:
    """``workers`` threads posting ``body`` to ``url`` until stopped; bounded by ``max_s`` whatever happens."""

    url: str
    key: str
    workers: int = 4
    pause_s: float = 0.02  # between a worker's requests: bounded load, CPU left for the rest of the machine
    max_s: float = 120.0
    body: bytes = b"the model learns to pred"
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(self.workers)]

    def _loop(self) -> None:
        deadline = time.monotonic() + self.max_s
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                t0 = time.time()
                try:
                    r = client.post(self.url, content=self.body, headers=headers)
                    s = Sample(t0, time.time(), r.status_code, r.headers.get("x-rewind-version"),
                               r.headers.get("x-rewind-instance"))  # fmt: skip
                except httpx.HTTPError:
                    s = Sample(t0, time.time(), 0, None)
                with self._lock:
                    self.samples.append(s)
                self._stop.wait(self.pause_s)

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count(self) -> int:
        with self._lock:
            return len(self.samples)

    def taken(self) -> list[Sample]:
        """The samples so far (a copy: the workers keep appending)."""
        with self._lock:
            return list(self.samples)

    @property
    def failed(self) -> list[Sample]:
        return [s for s in self.taken() if s.status != 200]
