"""A host lost: its share restored from the next host's memory (the peer ring) against from S3, in one run.

    .venv/bin/python -m bench.ring [--mib-per-rank 64] [--repeat 3]

Four gloo ranks on this machine play two hosts with their own disks (ranks 0-1 on disk a, 2-3 on disk b)
and their own memory tiers (directories on /dev/shm), with a shared tier on S3 (SeaweedFS on loopback).
Each repeat saves one checkpoint of the same state (``--mib-per-rank`` of float32 DTensor shards per rank,
sync: the ring's pass is inside the save) for each contender, then host b is lost (its disk and memory
removed) and ranks 2-3 come back on a spare disk c; the restore there is timed (the slowest rank), b's
files coming from a's memory (``ring``) or, with a's ring copy removed too, from S3 (``s3``). The order of
the two alternates from repeat to repeat. A third save per repeat with no memory tier gives the cost of
passing the shares round the ring in a save. Then every rank crashes with the hosts intact: three more
saves, each restored on the same disks, the disks' files evicted from the page cache first (what a restore
reads when the cache did not keep them), in rotating order: an async save, whose pass keeps each host's own
files beside its peer's share (``own_memory``); a sync save, whose pass inside the save (``REWIND_MEMORY_RING=on``) keeps the peer's share
alone (``peer_memory``: each host's own files from its disk); and a restore with no memory tier (``disk``: each
host's share from its disk, the other's sent by its ranks).

Writes to bench/results.json: ``ring_restore_ratio_vs_s3`` (restore after the host loss, median, ring
over S3), ``ring_save_ratio`` (a sync save with the ring over one without), ``ring_crash_restore_ratio_vs_disk``
(restore after every rank crashed, median, own memory over disks), ``ring_crash_own_ratio_vs_peer``
(the same, own memory over the peer's share alone) and ``ring`` (every figure, the machine). Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.multirank import _slowest, _state

HERE = Path(__file__).resolve().parent
CASES = ("ring", "s3")
CRASH = ("own_memory", "peer_memory", "disk")


def _place(work: Path, disk: str, memory: bool) -> Path:
    """This rank's disk and (env) memory tier, as a host named ``disk`` has them."""
    os.environ["REWIND_MEMORY_ROOT"] = str(work / "memory" / disk) if memory else "off"
    return work / "disks" / disk


def _save(
    work: Path, run: str, state: dict[str, Any], disk: str, *, memory: bool, mode: str = "sync"
) -> float:
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.sharded import ShardedCheckpointer

    root = _place(work, disk, memory)
    ck = ShardedCheckpointer(run, root=root, catalog=Catalog() if dist.get_rank() == 0 else None, mode=mode)
    started = time.perf_counter()
    ck.save(1, state, {"rank": dist.get_rank()})
    ck.wait()  # async: persisted and passed round the ring
    seconds = _slowest(time.perf_counter() - started)
    pusher = ck.send_on.pusher
    assert pusher is None or pusher.wait(300), "the share was not sent to S3 within 300 s"
    dist.barrier()
    ck.close()
    return seconds


def _lose_b(work: Path, run: str, case: str) -> None:
    """Rank 0: host b gone with its disk and memory (and, for ``s3``, a's ring copy of its share too)."""
    if dist.get_rank() == 0:
        shutil.rmtree(work / "disks" / "b" / run)
        shutil.rmtree(work / "memory" / "b" / ".ring" / run, ignore_errors=True)
        if case == "s3":
            shutil.rmtree(work / "memory" / "a" / ".ring" / run)
    dist.barrier()


def _evicted(work: Path, run: str) -> None:
    """Rank 0: both disks' copies of ``run`` out of the page cache."""
    from bench.memory_tier import _evict

    if dist.get_rank() == 0:
        for d in "ab":
            _evict(work / "disks" / d / run)
    dist.barrier()


def _restore(
    work: Path, run: str, state: dict[str, Any], disk: str, *, memory: bool = True
) -> tuple[float, dict[str, Any]]:
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.sharded import ShardedCheckpointer

    root = _place(work, disk, memory)
    ck = ShardedCheckpointer(run, root=root, catalog=Catalog() if dist.get_rank() == 0 else None)
    started = time.perf_counter()
    got = ck.restore_latest(state)
    seconds = _slowest(time.perf_counter() - started)
    assert got is not None and got[0] == 1, got
    read = dict(ck.read_from)
    ck.close()
    return seconds, read


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, work = dist.get_rank(), Path(args.work)
    state = _state(args.mib_per_rank, dist.get_world_size(), "cpu")
    got: dict[str, list[float]] = {"save_ring": [], "save_plain": [], "restore_ring": [], "restore_s3": []}
    got |= {f"crash_{c}": [] for c in CRASH}
    reads: dict[str, Any] = {}
    for i in range(args.repeat):
        got["save_plain"].append(_save(work, f"plain-{i}", state, "ab"[rank // 2], memory=False))
        for case in CASES if i % 2 == 0 else CASES[::-1]:
            run = f"{case}-{i}"
            got["save_ring"].append(_save(work, run, state, "ab"[rank // 2], memory=True))
            _lose_b(work, run, case)
            seconds, reads[case] = _restore(work, run, state, "ac"[rank // 2])
            got[f"restore_{case}"].append(seconds)
        for case in CRASH[i % 3 :] + CRASH[: i % 3]:  # every rank crashed, the hosts intact
            run = f"crash-{case}-{i}"
            _save(
                work,
                run,
                state,
                "ab"[rank // 2],
                memory=True,
                mode="async" if case == "own_memory" else "sync",
            )
            _evicted(work, run)
            seconds, reads[case] = _restore(work, run, state, "ab"[rank // 2], memory=case != "disk")
            got[f"crash_{case}"].append(seconds)
    if rank == 0:
        (work / "figures.json").write_text(json.dumps({"times": got, "read_from": reads}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib-per-rank", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.worker:
        worker(args)
        return
    from rewind.infra.drills.servers import SeaweedS3

    work = Path(
        tempfile.mkdtemp(prefix="rewind-bench-ring-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    disks = Path(tempfile.mkdtemp(prefix="rewind-bench-ring-", dir=HERE))  # disks on disk, memory on /dev/shm
    server = SeaweedS3(disks / "weed")
    try:
        server.start()
        server.client().create_bucket(Bucket="bench")
        (disks / "disks").mkdir()
        (work / "disks").symlink_to(disks / "disks")
        env = {**os.environ, **server.env, "OMP_NUM_THREADS": "1", "REWIND_HOME": str(disks),
               "REWIND_CATALOG_URL": f"sqlite:///{disks / 'catalog.db'}", "REWIND_SHARED_URI": "s3://bench/ring", "REWIND_MEMORY_RING": "on"}  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--master-port=29517",
               "-m", "bench.ring", "--worker", "--work", str(work), "--mib-per-rank", str(args.mib_per_rank),
               "--repeat", str(args.repeat)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=HERE.parent, env=env)
        _report(json.loads((work / "figures.json").read_text()), args)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disks, ignore_errors=True)


def _report(fig: dict[str, Any], args: argparse.Namespace) -> None:
    from bench.run import machine

    t = {k: statistics.median(v) for k, v in fig["times"].items()}
    keys = {
        "ring_restore_ratio_vs_s3": t["restore_ring"] / t["restore_s3"],
        "ring_save_ratio": t["save_ring"] / t["save_plain"],
        "ring_crash_restore_ratio_vs_disk": t["crash_own_memory"] / t["crash_disk"],
        "ring_crash_own_ratio_vs_peer": t["crash_own_memory"] / t["crash_peer_memory"],
    }
    for k, v in {**t, **keys}.items():
        print(f"  {k:30} {v:10.4f}")
    print(json.dumps(fig["read_from"], indent=1))
    out = HERE / "results.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    results |= keys | {"ring": {"seconds": t, "read_from": fig["read_from"], "mib_per_rank": args.mib_per_rank,
                                "repeat": args.repeat, "machine": machine()}}  # fmt: skip
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
