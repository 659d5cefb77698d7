"""The optional write limit (``REWIND_WRITE_LIMIT``): writes are paced to it, bad values refused in one line."""

from __future__ import annotations

import time

import pytest
import torch

from rewind.infra import sizes, throttle
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.errors import ConfigError


class VirtualClock:
    """Time that passes only when the throttle sleeps: the pacing is computed, never waited for."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_bucket_holds_writes_to_the_rate_after_one_second_of_burst():
    t = VirtualClock()
    limit = throttle.Throttle(1 << 20, clock=t.clock, sleep=t.sleep)
    for _ in range(160):  # 10 MiB in 64 KiB writes
        limit.take(64 << 10)
    assert t.now == pytest.approx(9.0)  # the first MiB is the burst, the other nine take a second each


def test_a_write_larger_than_the_bucket_is_a_debt_the_next_writer_also_pays():
    t = VirtualClock()
    limit = throttle.Throttle(1 << 20, clock=t.clock, sleep=t.sleep)
    limit.take(4 << 20)
    assert t.now == pytest.approx(3.0)
    limit.take(1 << 20)  # the bucket refilled nothing while the debt was slept off
    assert t.now == pytest.approx(4.0)


@pytest.mark.parametrize(
    "text,want", [("200MiB", 200 << 20), ("1.5GB", 1_500_000_000), ("500m", 500_000_000)]
)
def test_sizes_read_as_people_write_them(text, want):
    assert sizes.parse(text) == want


@pytest.mark.parametrize(
    "value,why", [("fast", "is not a size"), ("0", "is under the least"), ("200", "is under the least")]
)
def test_a_bad_limit_is_refused_when_the_checkpointer_is_made(
    rewind_env, run_name, tmp_path, monkeypatch, value, why
):
    monkeypatch.setenv(throttle.ENV, value)
    with pytest.raises(ConfigError, match=f"REWIND_WRITE_LIMIT: '{value}' {why}") as err:
        Checkpointer(run_name, states={"m": torch.nn.Linear(2, 2)}, root=tmp_path, catalog=Catalog())
    assert "\n" not in str(err.value)


def test_one_large_write_is_paced_in_slices_not_sent_as_one_burst(monkeypatch):
    """A whole tensor handed to the writer at once still goes out at the limit, a slice at a time."""
    import io

    from rewind.infra.format.digest import HashingWriter

    monkeypatch.setenv(throttle.ENV, "8MiB")
    limit = throttle.for_writes()
    assert limit is not None
    charged: list[int] = []
    monkeypatch.setattr(limit, "take", charged.append)
    out = io.BytesIO()
    data = bytes(range(256)) * (96 << 12)  # 96 MiB in one call
    assert HashingWriter(out).write(data) == len(data) and out.getvalue() == data
    assert max(charged) == 1 << 20 and sum(charged) == len(data)


def test_a_save_under_a_limit_takes_at_least_what_the_limit_allows(
    rewind_env, run_name, tmp_path, monkeypatch
):
    """16 MiB at 8 MiB/s: the first second's worth is a burst, the rest cannot go faster than the limit."""
    monkeypatch.setenv(throttle.ENV, "8MiB")
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights
    ck = Checkpointer(run_name, states={"m": model}, root=tmp_path, catalog=Catalog())
    started = time.monotonic()
    ck.save(1)
    elapsed = time.monotonic() - started
    ck.close()
    assert elapsed >= 0.95  # a lower bound: load can only make it slower
