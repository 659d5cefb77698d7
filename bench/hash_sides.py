"""Where an async save hashes, on a job that holds every core: in the stall against in the background, in one
process and one run, interleaved.

Each round is three intervals of the same job in a rotating order: one without a save, one with a save
hashed in the stall (``REWIND_HASH_IN_STALL=on``), one hashed in the background (``off``); the setting is
read at each save, so both sides share the Checkpointer, its staging buffer and the machine's drift. Each
side's overhead is the median of its rounds' own ratios to the round's interval without a save. Run by
``python -m bench.run --sections training`` (on all cores) after the training section's own measurements.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from bench.run import median
from bench.training import _drop_older, _plain, _saved, _tiny_job
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import stall_hash
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode

SIDES = ("on", "off")
ORDERS = (("none", "on", "off"), ("on", "off", "none"), ("off", "none", "on"))


def _round(ck: Checkpointer, step, every: int, order: tuple[str, ...], at: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    took: dict[str, float] = {}
    for side in order:
        if side == "none":
            took[side] = _plain(step, every)
            continue
        os.environ[stall_hash.ENV] = side
        took[side], _ = _saved(ck, step, every, at)
        at += 1
    return took


def bench_hash_sides(work: Path, threads: int, rounds: int, every: int) -> dict[str, float]:
    """``rounds`` rounds of the three intervals of ``every`` steps; each side's overhead (%)."""
    before = os.environ.get(stall_hash.ENV)
    model, opt, step = _tiny_job(threads)
    cat = Catalog(f"sqlite:///{work / 'hash-sides.db'}")
    ck = Checkpointer("bench-hash-sides", states={"model": model, "optimizer": opt}, root=work / "hs",
                      catalog=cat, mode=SaveMode.ASYNC)  # fmt: skip
    took: dict[str, list[float]] = {side: [] for side in ("none", *SIDES)}
    try:
        ck.save(0)  # the staging buffer made: not timed
        ck.wait()
        for r in range(rounds):
            _drop_older(ck)
            order = ORDERS[r % len(ORDERS)]
            for side, s in _round(ck, step, every, order[::-1] if r % 2 else order, 10 + 2 * r).items():
                took[side].append(s)
    finally:
        ck.close()
        os.environ.pop(stall_hash.ENV, None)
        if before is not None:
            os.environ[stall_hash.ENV] = before
    out: dict[str, float] = {"rounds": rounds, "every": every, "step_s": median(took["none"]) / every}
    for side in SIDES:
        pct = [100 * (w / o - 1) for w, o in zip(took[side], took["none"], strict=True)]
        q1, _, q3 = statistics.quantiles(pct, n=4, method="inclusive")
        out[f"{side}_pct"], out[f"{side}_q1_pct"], out[f"{side}_q3_pct"] = median(pct), q1, q3
    vs = [100 * (a / b - 1) for a, b in zip(took["on"], took["off"], strict=True)]
    out["on_vs_off_pct"] = median(vs)  # each round's interval hashed in the stall over the one hashed behind
    return out


def report_hash_sides(results: dict, t: dict[str, float]) -> None:
    print(
        f"\n== hashed in the stall or in the background, every core training: {t['rounds']:.0f} rounds "
        f"interleaved, checkpoint every {t['every']:.0f} steps of {t['step_s']:.3f} s =="
    )
    for side in SIDES:
        print(
            f"  {stall_hash.ENV}={side}: overhead {t[f'{side}_pct']:.1f}% (median of the rounds' own ratios; "
            f"quartiles {t[f'{side}_q1_pct']:.1f}% and {t[f'{side}_q3_pct']:.1f}%)"
        )
    print(
        f"  an interval hashed in the stall against one hashed behind, same round: {t['on_vs_off_pct']:+.1f}%"
    )
    results["training_hash_sides"] = t
    results["training_overhead_all_cores_hashed_in_stall_pct"] = t["on_pct"]
    results["training_overhead_all_cores_hashed_behind_pct"] = t["off_pct"]


def measure_and_report(results: dict, work: Path, args: argparse.Namespace) -> None:
    """On every core (``--train-threads`` at least the cores): the two sides at the all-cores interval."""
    threads = args.train_threads or os.cpu_count() or 1
    if threads < (os.cpu_count() or 1) or "training" not in results:
        return  # a core left to the background persist: nothing to choose between
    every = next(  # the interval of the all-cores measurement at the configured settings
        int(t["every"])
        for t in results["training"]
        if t["threads"] == threads
        and not t.get("priority_alternative")
        and not t.get("page_cache_alternative")
    )
    report_hash_sides(results, bench_hash_sides(work, threads, args.train_runs, every))
