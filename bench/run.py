"""Checkpoint speed, measured against what users run today, in one process on the same data.

    make bench            # or: python -m bench.run [--gib 1.0] [--repeat 3] [--dir PATH]

Every figure is a median over repeats, and every ratio compares numbers taken in
this run: Rewind async stall vs torch.save+fsync, DCP save and DCP async_save;
background persist vs a raw fsync'd write of the same bytes; restore with deep
verification vs torch.load(weights_only=True); a process's first async save with its staging
buffer prepared beforehand vs made at the save; training steps/s with and without
checkpoints. Writes bench/results.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.format import manifest as mf
from rewind.infra.format import payload

HERE = Path(__file__).resolve().parent
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Blob(torch.nn.Module):
    """A state of a given size in 64 MiB float32 parameters (optimizer-free, to isolate I/O)."""

    def __init__(self, gib: float, device: str = "cpu") -> None:
        super().__init__()
        n = max(1, round(gib * 16))
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(16 << 20, device=device)) for _ in range(n)
        )

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def fsync_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def machine() -> dict[str, str]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "?",
    )
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory_gib": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }


# -- 1 + 2: stall and persist -------------------------------------------------------


def bench_stall_and_persist(work: Path, gib: float, repeat: int, device: str) -> dict[str, Any]:
    blob = Blob(gib, device)
    sd = blob.state_dict()
    nbytes = blob.nbytes
    res: dict[str, list[float]] = {
        k: []
        for k in (
            "rewind_async",
            "rewind_async_gpu_done",
            "rewind_persist",
            "rewind_sync",
            "torch_save",
            "dcp_save",
            "dcp_async",
            "raw_write",
        )
    }
    cat = Catalog(f"sqlite:///{work / 'bench.db'}")
    ck = Checkpointer(
        f"bench-{device}", states={"model": blob}, root=work / "ckpt", catalog=cat, mode=SaveMode.ASYNC
    )
    sync = Checkpointer(f"bench-sync-{device}", states={"model": blob}, root=work / "ckpt", catalog=cat)
    ck.save(0)  # allocates the reusable staging buffer
    ck.wait()
    raw = torch.empty(nbytes, dtype=torch.uint8)
    raw.view(torch.float32).copy_(torch.cat([p.detach().reshape(-1).cpu() for p in blob.parameters()]))
    for i in range(1, repeat + 1):
        t0 = time.perf_counter()
        res["rewind_async"].append(ck.save(i))
        if device == "cuda":  # the compute stream waits for the side stream's copy: until it is done
            torch.cuda.current_stream().synchronize()
        res["rewind_async_gpu_done"].append(time.perf_counter() - t0)
        ck.wait()
        res["rewind_persist"].append(time.perf_counter() - t0)
        res["rewind_sync"].append(sync.save(i))
        _baselines(work / f"b{i}", sd, raw, res)
    ck.close()
    m: dict[str, Any] = {k: median(v) for k, v in res.items()}
    m["bytes"] = nbytes
    m["dd_line"] = _dd_line(work, nbytes)
    return m


def _baselines(
    work: Path, sd: dict[str, torch.Tensor], raw: torch.Tensor, res: dict[str, list[float]]
) -> None:
    """One repeat of each baseline into ``work`` (removed after): torch.save, DCP save and async_save (its
    stall), and the raw bytes written in 8 MiB pieces; each fsynced."""
    work.mkdir()

    def torch_save() -> None:
        with open(work / "t.pt", "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    def raw_write() -> None:
        view = memoryview(raw.numpy())
        with open(work / "raw", "wb") as f:
            for off in range(0, len(view), 8 << 20):
                f.write(view[off : off + (8 << 20)])
            f.flush()
            os.fsync(f.fileno())

    res["torch_save"].append(timed(torch_save))
    res["dcp_save"].append(timed(lambda: dcp.save(sd, checkpoint_id=str(work / "dcp"))))
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, checkpoint_id=str(work / "dcpa"))
    res["dcp_async"].append(time.perf_counter() - t0)
    fut.result()
    res["raw_write"].append(timed(raw_write))
    shutil.rmtree(work)


def _dd_line(work: Path, nbytes: int) -> str:
    """What ``dd`` says of writing ``nbytes`` of zeros with an fsync: the disk's own speed, for the report."""
    dd = subprocess.run(
        ["dd", "if=/dev/zero", f"of={work / 'dd'}", "bs=8M", f"count={nbytes >> 23}", "conv=fsync"],
        capture_output=True,
        text=True,
        check=False,
    )
    (work / "dd").unlink(missing_ok=True)
    return dd.stderr.strip().splitlines()[-1] if dd.stderr else ""


# -- 3: restore -----------------------------------------------------------------


def bench_restore(work: Path, gib: float, repeat: int) -> dict[str, float]:
    blob = Blob(gib)
    cat = Catalog(f"sqlite:///{work / 'restore.db'}")
    ck = Checkpointer("bench-restore", states={"model": blob}, root=work / "rck", catalog=cat)
    ck.save(1)
    directory = work / "rck" / "bench-restore" / "step-1"
    torch.save(blob.state_dict(), work / "r.pt")
    manifest = mf.read(directory)
    ours, theirs, full = [], [], []
    for _ in range(repeat):
        theirs.append(timed(lambda: torch.load(work / "r.pt", weights_only=True)))
        ours.append(timed(lambda: payload.read_states(directory, manifest)))
        full.append(timed(ck.restore_latest))
    return {
        "rewind_read_verified": median(ours),
        "torch_load": median(theirs),
        "rewind_restore_into_model": median(full),
    }


def report_stall(results: dict, s: dict, repeat: int) -> None:
    gb = s["bytes"] / 1e9
    print(f"\n== stall per save of {gb:.2f} GB (median of {repeat}) ==")
    for k, label in [
        ("rewind_async", "rewind async"),
        ("rewind_sync", "rewind sync"),
        ("torch_save", "torch.save+fsync"),
        ("dcp_save", "DCP save"),
        ("dcp_async", "DCP async_save"),
    ]:
        print(f"  {label:18} {s[k]:8.3f} s   ratio vs rewind async: {s[k] / s['rewind_async']:6.1f}x")
    print(f"\n== background persist vs raw fsync'd write of the same {gb:.2f} GB ==")
    print(f"  rewind persist     {s['rewind_persist']:8.3f} s  {gb / s['rewind_persist']:6.2f} GB/s")
    print(f"  python write+fsync {s['raw_write']:8.3f} s  {gb / s['raw_write']:6.2f} GB/s")
    print(f"  dd conv=fsync      {s['dd_line']}")
    results["stall"] = s
    results["stall_ratio_vs_torch_save"] = s["rewind_async"] / s["torch_save"]
    results["stall_ratio_vs_dcp_async"] = s["rewind_async"] / s["dcp_async"]
    results["persist_ratio_vs_raw_write"] = s["raw_write"] / s["rewind_persist"]  # throughput ratio


def report_restore(results: dict, r: dict) -> None:
    print("\n== restore with deep verification vs torch.load(weights_only=True) ==")
    print(f"  torch.load                 {r['torch_load']:8.3f} s")
    ratio = r["rewind_read_verified"] / r["torch_load"]
    print(f"  rewind read+verify         {r['rewind_read_verified']:8.3f} s   ratio {ratio:.2f}x")
    print(f"  rewind restore into model  {r['rewind_restore_into_model']:8.3f} s")
    results["restore"] = r
    results["restore_ratio_vs_torch_load"] = ratio


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size for the save/restore benchmarks")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--train-runs", type=int, default=5, help="intervals measured with and without a save")
    p.add_argument(
        "--train-threads",
        type=int,
        default=None,
        help="torch threads of the training loop (default: cores-1, then all cores as a second figure)",
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir beside this file)"
    )
    p.add_argument(
        "--sections",
        default="stall,restore,first,training",
        help="comma-separated subset of stall,restore,first,training",
    )
    return p


def _gpu_stall(results: dict, work: Path, gib: float, repeat: int) -> None:
    g = bench_stall_and_persist(work, gib, repeat, "cuda")
    print(f"\n== GPU stall ({torch.cuda.get_device_name(0)}) ==")
    for k in ("rewind_async", "rewind_async_gpu_done", "torch_save", "dcp_async"):
        print(f"  {k:22} {g[k]:8.3f} s")
    results["gpu"] = g
    results["gpu_stall_ratio_vs_torch_save"] = g["rewind_async"] / g["torch_save"]
    results["gpu_stall_ratio_vs_dcp_async"] = g["rewind_async"] / g["dcp_async"]
    # the host's stall above; this one lasts until the GPU's own copy is done (what the next kernel waits for)
    results["gpu_stall_done_ratio_vs_dcp_async"] = g["rewind_async_gpu_done"] / g["dcp_async"]


SUMMARY = (
    "stall_ratio_vs_torch_save",
    "stall_ratio_vs_dcp_async",
    "persist_ratio_vs_raw_write",
    "restore_ratio_vs_torch_load",
    "first_save_stall_ratio_prepared",
    "training_overhead_pct",
    "training_overhead_all_cores_pct",
    "training_overhead_all_cores_paired_pct",
    "training_overhead_all_cores_paired_q1_pct",
    "training_overhead_all_cores_paired_q3_pct",
    "training_overhead_all_cores_paired_ci95_low_pct",
    "training_overhead_all_cores_paired_ci95_high_pct",
    "training_overhead_all_cores_idle_priority_pct",
    "training_overhead_all_cores_page_cache_pct",
    "training_overhead_all_cores_hashed_in_stall_pct",
    "training_overhead_all_cores_hashed_behind_pct",
    "commit_after_s_all_cores",
    "commit_after_s_all_cores_idle_priority",
)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sections = set(args.sections.split(","))
    logging.basicConfig(level=logging.WARNING)
    out = HERE / "results.json"
    results: dict = (
        json.loads(out.read_text())
        if out.exists() and sections != {"stall", "restore", "first", "training"}
        else {}
    )
    results |= {"machine": machine(), "gib": args.gib, "repeat": args.repeat}
    print(f"machine: {results['machine']}")
    work = Path(tempfile.mkdtemp(prefix="rewind-bench-", dir=args.dir or HERE))
    try:
        if "stall" in sections:
            report_stall(results, bench_stall_and_persist(work, args.gib, args.repeat, "cpu"), args.repeat)
            if torch.cuda.is_available():
                _gpu_stall(results, work, args.gib, args.repeat)
        if "restore" in sections:
            report_restore(results, bench_restore(work, args.gib, args.repeat))
        if "first" in sections:
            from bench import first_save

            first_save.report(results, first_save.measure(work, args.gib, args.repeat))
        if "training" in sections:
            from bench.hash_sides import measure_and_report as hash_sides
            from bench.training import measure_and_report

            measure_and_report(results, work, args)
            hash_sides(results, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n== summary (ratios measured in one run) ==")
    for k in SUMMARY:
        if k in results:
            print(f"  {k:30} {results[k]:.3f}")
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
