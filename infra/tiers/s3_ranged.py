"""Reading a large S3 object as several ranged GETs in flight, handed out in order.

One stream per object caps a download at what one connection carries (about
100 MB/s on AWS); boto3's transfer manager fetches ranges in parallel but only
into a file. This keeps the tier's stream interface: the first range is fetched
by ``open`` (its Content-Range tells the size), the next ones are requested ahead,
at most ``window`` ranges of ``part`` bytes in memory at once. Every range is asked
for with the first one's ETag (``If-Match``), so an object replaced mid-read is an
error, never a mix of two objects' bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

Fetch = Callable[[int, int], bytes]  # bytes [start, end) of the object


class RangedBody:
    """A read-once stream over ``total`` bytes: ``first`` (already fetched), then ranges from ``fetch``."""

    def __init__(self, fetch: Fetch, first: bytes, total: int, *, part: int, window: int) -> None:
        self._fetch, self._total, self._part = fetch, total, part
        self._pool = ThreadPoolExecutor(max(1, window), thread_name_prefix="s3-range")
        self._ahead: deque[Future[bytes]] = deque()
        self._next = len(first)  # the first byte no request covers yet
        self._buf = memoryview(first)
        self._failed: BaseException | None = None
        for _ in range(max(1, window)):
            self._request()

    def _request(self) -> None:
        if self._next < self._total:
            end = min(self._total, self._next + self._part)
            self._ahead.append(self._pool.submit(self._fetch, self._next, end))
            self._next = end

    def _refill(self) -> bool:
        if self._failed is not None:
            raise self._failed  # a stream with a hole in it never reads on
        if not self._ahead:
            return False
        try:
            data = self._ahead.popleft().result()
        except BaseException as exc:
            self._failed = exc
            self.close()
            raise
        self._request()
        self._buf = memoryview(data)
        return True

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all that is left when ``n`` < 0); fewer only at the end, as a file does."""
        out: list[bytes] = []
        want = n if n >= 0 else self._total
        while want > 0 and (self._buf or self._refill()):
            piece, self._buf = self._buf[:want], self._buf[want:]
            out.append(bytes(piece))
            want -= len(piece)
        return b"".join(out)

    def close(self) -> None:
        for f in self._ahead:
            f.cancel()
        self._ahead.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RangedBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
