"""Training overhead: a 51M-parameter job on the CPU with and without a background save per interval.

Run by ``python -m bench.run --sections training``. The interval is chosen so that the persist is about 10%
of it; on all cores the other persist priority and the page cache (``REWIND_DIRECT_WRITES=off``) are measured
beside at the same interval, and where the files are hashed (``bench.hash_sides``: in the stall against in
the background, interleaved in one process). Each interval with a save includes its whole persist.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.run import median, timed
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import priority as persist_priority
from rewind.infra.checkpoint import stall_hash
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.format import direct


def _tiny_job(threads: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A 51M-parameter TinyLM with AdamW on ``threads`` torch threads, warmed up; its step."""
    from rewind.examples.tiny_lm_model import TinyLM

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = TinyLM(vocab=256, block=64, dim=512, layers=16, heads=8, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (4, 64))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, 256), x.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    return model, opt, step


def _plain(step: Callable[[], None], every: int) -> float:
    t0 = time.perf_counter()
    for _ in range(every):
        step()
    return time.perf_counter() - t0


def _saved(ck: Checkpointer, step: Callable[[], None], every: int, at: int) -> tuple[float, float]:
    """An interval with a save of step ``at`` at its first step (its whole persist inside it); and how long
    after ``save()`` the commit was seen."""
    t0 = time.perf_counter()
    committed_s = None
    for i in range(every):
        step()
        if i == 0:
            ck.save(at)
            saved_at = time.perf_counter()
        elif committed_s is None and ck.last_saved is not None and ck.last_saved.step == at:
            committed_s = time.perf_counter() - saved_at  # seen at a step's end: within a step
    ck.wait()  # the interval includes the whole persist: no save is left running
    took = time.perf_counter() - t0
    return took, committed_s if committed_s is not None else time.perf_counter() - saved_at


def _persisted(ck: Checkpointer, at: int) -> float:
    """Seconds from ``save()`` to the commit of step ``at``, nothing else running."""
    _drop_older(ck)
    t0 = time.perf_counter()
    ck.save(at)
    ck.wait()
    return time.perf_counter() - t0


def _intervals(
    ck: Checkpointer, step: Callable[[], None], *, every: int, runs: int
) -> tuple[list[float], list[float], list[float]]:
    """``runs`` pairs of intervals of ``every`` steps, one without a save and one with, in turn first (a
    machine drifting in speed slows both of a pair alike); and how long after ``save()`` each commit was
    seen."""
    with_ck: list[float] = []
    without: list[float] = []
    commit_after: list[float] = []  # from save() to the commit, while the job trains
    for r in range(runs):
        _drop_older(ck)  # between pairs, outside every timed interval
        if r % 2:
            took, seen = _saved(ck, step, every, r * every + 4)
            without.append(_plain(step, every))
        else:
            without.append(_plain(step, every))
            took, seen = _saved(ck, step, every, r * every + 4)
        with_ck.append(took)
        commit_after.append(seen)
    return without, with_ck, commit_after


BOOTSTRAP_SEED = 26  # reported with the interval: the same pairs give the same interval
BOOTSTRAP_DRAWS = 2000


def _drop_older(ck: Checkpointer) -> None:
    """Every checkpoint directory of the run but the newest save's removed (the catalog still lists them:
    nothing here restores): a run of 21 pairs would otherwise keep 21 copies of the state per measurement,
    tens of GB for the three measurements of the section."""
    newest = Path(ck.last_saved.path) if ck.last_saved is not None else None
    for d in ck.run_dir.glob("step-*"):
        if d != newest:
            shutil.rmtree(d, ignore_errors=True)


def _paired(with_ck: list[float], without: list[float]) -> dict[str, float]:
    """Each pair's own overhead (%): its median, its quartiles (how far runs of the same job on this machine
    differ), and a 95% bootstrap interval of that median (pairs drawn with replacement, seed
    ``BOOTSTRAP_SEED``): a target inside the interval is neither met nor missed by this run."""
    pct = [100 * (w / o - 1) for w, o in zip(with_ck, without, strict=True)]
    q1, _, q3 = (
        statistics.quantiles(pct, n=4, method="inclusive") if len(pct) > 1 else (pct[0], pct[0], pct[0])
    )
    draw = random.Random(BOOTSTRAP_SEED)
    medians = sorted(median(draw.choices(pct, k=len(pct))) for _ in range(BOOTSTRAP_DRAWS))
    low, high = medians[int(0.025 * BOOTSTRAP_DRAWS)], medians[int(0.975 * BOOTSTRAP_DRAWS) - 1]
    return {"paired_overhead_pct": median(pct), "paired_q1_pct": q1, "paired_q3_pct": q3,
            "paired_ci95_low_pct": low, "paired_ci95_high_pct": high}  # fmt: skip


def bench_training(
    work: Path,
    steps: int,
    threads: int,
    runs: int,
    *,
    env: dict[str, str] | None = None,
    every: int | None = None,
) -> dict[str, float | str]:
    """``env``: settings for this measurement alone (REWIND_PERSIST_PRIORITY, REWIND_DIRECT_WRITES);
    ``every``: checkpoint every so many steps (default: the persist ~10% of the interval)."""
    if env:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return bench_training(work, steps, threads, runs, every=every)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
    model, opt, step = _tiny_job(threads)
    params = sum(p.numel() for p in model.parameters())
    cat = Catalog(f"sqlite:///{work / 'train.db'}")
    ck = Checkpointer(
        "bench-train",
        states={"model": model, "optimizer": opt},
        root=work / "tck",
        catalog=cat,
        mode=SaveMode.ASYNC,
    )
    ck.save(0)  # the first save allocates the staging buffer (faults in a copy of the state): not timed
    ck.wait()
    persist = median([_persisted(ck, at) for at in (1, 2, 3)])  # a save as every later one is: the
    # interval is ~10 times it (a median of three: one save alone put it either side of a step's tenth)
    base = [timed(step) for _ in range(steps)]
    step_s = median(base)
    every = every or max(1, math.ceil(10 * persist / step_s))  # persist is ~10% of the interval
    without, with_ck, commit_after = _intervals(ck, step, every=every, runs=runs)
    ck.close()
    return {
        "params_m": params / 1e6,
        "threads": threads,
        "runs": runs,
        "step_s": step_s,
        "persist_s": persist,
        "every": every,
        "interval_without_s": median(without),
        "interval_with_s": median(with_ck),
        **_paired(with_ck, without),
        "commit_after_s": median(commit_after),
        "persist_priority": persist_priority.configured().value,
        "hash_in_stall": stall_hash.configured(),
        "direct_writes": direct.wanted(),
    }


def _all_cores(results: dict, t: dict) -> None:
    results["training_overhead_all_cores_pct"] = t["overhead_pct"]
    results["training_overhead_all_cores_paired_pct"] = t["paired_overhead_pct"]
    results["training_overhead_all_cores_paired_q1_pct"] = t["paired_q1_pct"]
    results["training_overhead_all_cores_paired_q3_pct"] = t["paired_q3_pct"]
    results["training_overhead_all_cores_paired_ci95_low_pct"] = t["paired_ci95_low_pct"]
    results["training_overhead_all_cores_paired_ci95_high_pct"] = t["paired_ci95_high_pct"]
    results["commit_after_s_all_cores"] = t["commit_after_s"]


def report_training(results: dict, runs: list[dict]) -> None:
    """The headline leaves one core to the persist thread; the all-cores figure is reported beside it."""
    for t in runs:
        overhead = 100 * (t["interval_with_s"] / t["interval_without_s"] - 1)
        t["overhead_pct"] = overhead
        share = 100 * t["persist_s"] / (t["every"] * t["step_s"])
        print(
            f"\n== training overhead: {t['params_m']:.0f}M-param model, {t['threads']} torch thread(s) of "
            f"{os.cpu_count()} cores, checkpoint every {t['every']} steps, median of {t['runs']} intervals =="
        )
        print(f"  step {t['step_s']:.3f} s, persist {t['persist_s']:.3f} s ({share:.0f}% of the interval)")
        print(
            f"  persist at priority {t['persist_priority']}, {stall_hash.ENV}={t['hash_in_stall']}: committed "
            f"{t['commit_after_s']:.2f} s after save() while the job trained"
        )
        print(
            f"  interval without checkpoint {t['interval_without_s']:.2f} s, with {t['interval_with_s']:.2f} s: "
            f"overhead {overhead:.1f}% (median of the pairs' own ratios: {t['paired_overhead_pct']:.1f}%, "
            f"their quartiles {t['paired_q1_pct']:.1f}% and {t['paired_q3_pct']:.1f}%; 95% interval of that "
            f"median {t['paired_ci95_low_pct']:.1f}% to {t['paired_ci95_high_pct']:.1f}%, bootstrap seed "
            f"{BOOTSTRAP_SEED})"
        )
    results["training"] = runs
    results["training_overhead_pct"] = runs[0]["overhead_pct"]
    if runs[0]["threads"] >= (os.cpu_count() or 1):  # asked for every core (--train-threads): that figure
        _all_cores(results, runs[0])
    for t in runs[1:]:
        if t.get("page_cache_alternative"):  # the persist's files written through the page cache
            results["training_overhead_all_cores_page_cache_pct"] = t["overhead_pct"]
            results["commit_after_s_all_cores_page_cache"] = t["commit_after_s"]
        elif t.get("priority_alternative"):  # e.g. training_overhead_all_cores_idle_priority_pct
            results[f"training_overhead_all_cores_{t['persist_priority']}_priority_pct"] = t["overhead_pct"]
            results[f"commit_after_s_all_cores_{t['persist_priority']}_priority"] = t["commit_after_s"]
        else:
            _all_cores(results, t)


def measure_and_report(results: dict, work: Path, args: argparse.Namespace) -> None:
    """The job with and without saves; on all cores also the other persist priority, the page cache and the
    two sides of the hash, each at the same checkpoint interval as the configured persist."""
    cores = os.cpu_count() or 1
    threads = [args.train_threads] if args.train_threads else sorted({max(1, cores - 1), cores})
    runs = [bench_training(work, args.train_steps, n, args.train_runs) for n in threads]
    other = (  # the persist at the other end of REWIND_PERSIST_PRIORITY, measured beside
        persist_priority.PersistPriority.NORMAL
        if persist_priority.configured() is persist_priority.PersistPriority.IDLE
        else persist_priority.PersistPriority.IDLE
    )
    same = {"every": int(runs[-1]["every"])}
    prio = {persist_priority.ENV: other.value}
    alt = bench_training(work, args.train_steps, threads[-1], args.train_runs, env=prio, **same)
    runs.append(alt | {"priority_alternative": True})
    cached = {direct.ENV: "off"}
    page = bench_training(work, args.train_steps, threads[-1], args.train_runs, env=cached, **same)
    runs.append(page | {"page_cache_alternative": True})
    report_training(results, runs)
