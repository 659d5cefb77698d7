"""Restore from the memory tier against restore from the local disk: the same checkpoint, the same path.

One single-process checkpoint of a model (``--mib`` of float32 in 16 tensors) is saved to the local tier on
disk and copied into a memory tier on /dev/shm by the memory agent's own function (``keeper.keep``); then it
is restored through the one restore path (``restore.execute``, every byte hashed against the catalog's
digest) into the model by the checkpointer's own load, as ``Checkpointer.restore_latest`` does, from the memory copy and from the local copy, alternating, median of
``--repeats``. The local copy is measured twice: with its pages evicted from the page cache first
(``posix_fadvise(DONTNEED)``: what a restore reads when the cache did not keep the checkpoint, e.g. a
machine whose memory the job filled) and as the page cache left it (a crash right after the save).

A module copies what it is given into its own tensors, so its part is read from memory over the tier's
pages (``rewind.infra.format.mapped``, copy-on-write) with no copy of its own. A part whose tensors the job
keeps (a dict, an optimizer's state) is read into new tensors from either tier: measured as well, the same
bytes read as kept tensors (``read_states`` alone). Writes ``memory_tier_restore_ratio_vs_local`` (into the
model, evicted), ``memory_tier_restore_ratio_vs_local_cached``, ``memory_tier_restore_kept_ratio_vs_local``
(kept tensors, evicted), ``memory_tier_kept_mapped_written_ratio`` (kept tensors restored from memory and
written once: read over the mapping, which the restore does not do, over read into new tensors) and
``memory_tier_keep_s`` (the agent's copy into memory, off the job's path) to bench/results.json.
``--huge-pages`` (root) measures the same again with the memory tier on a tmpfs mounted ``huge=within_size``
(in a mount namespace of its own), keys ending in ``_huge_pages``: what a node whose operator mounts its
memory tier so gets (docs/recovery.md).
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

HERE = Path(__file__).resolve().parent


def _evict(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _restore_s(run: str, root: Path, tier: str, evict: Path | None, into: Any, written: str = "") -> float:
    """Seconds to restore from ``tier`` through ``into`` (a checkpointer's own load, as ``restore_latest``
    hands the restore; None: the tensors read and kept, not copied). ``written``: the tensors kept, each
    written once after (``mapped``: read over the memory copy's pages, as the restore never does for kept
    tensors: what a first write to them would cost)."""
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.format import dropping, payload
    from rewind.infra.restore import execute, plan

    def load(directory: Path, manifest: Any) -> None:
        if written:
            got = payload.read_states(directory, manifest, copied=("model",) if written == "mapped" else ())
            for t in got["model"].values():
                t.add_(1.0)
        elif into is None:
            payload.read_states(directory, manifest)
        else:
            into(directory, manifest)

    cat = Catalog()
    if evict is not None:
        _evict(evict)
    started = time.perf_counter()
    done = execute.execute(cat, plan.plan(cat, run, root=root, tiers=(tier,)), load)
    seconds = time.perf_counter() - started
    assert done.source == tier, done.source
    dropping.dropped()  # the parts' teardown done before the next timed restore, outside the timer
    return seconds


def measure(mib: int, repeats: int, work: Path) -> dict[str, Any]:
    import torch

    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.memory import keeper, place

    cfg = place.config()
    assert cfg is not None, "no memory tier on this machine"
    n = mib * (1 << 20) // 4 // 16
    model = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(n)) for i in range(16)})
    cat, root = Catalog(), work / "ckpt"
    ck = Checkpointer("bench", states={"model": model}, root=root, catalog=cat)
    ck.save(1)
    saved = ck.last_saved
    assert saved is not None
    kept = keeper.keep(cat, saved.checkpoint_id, cfg)
    assert kept is not None
    kinds = ["memory", "local", "local_cached", "memory_kept", "local_kept"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(repeats):
        for what in kinds if i % 2 == 0 else kinds[::-1]:
            tier = "memory" if what.startswith("memory") else "local"
            evict = Path(saved.path) if tier == "local" and what != "local_cached" else None
            times[what].append(
                _restore_s("bench", root, tier, evict, None if what.endswith("kept") else ck._load)
            )
    for _ in range(3):  # why kept tensors are never mapped: the first write's copy-on-write faults
        for how in ("mapped", "read"):
            times.setdefault(f"memory_kept_{how}_written", []).append(
                _restore_s("bench", root, "memory", None, None, how)
            )
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "memory_tier_restore_ratio_vs_local": round(med["memory"] / med["local"], 3),
        "memory_tier_restore_ratio_vs_local_cached": round(med["memory"] / med["local_cached"], 3),
        "memory_tier_restore_kept_ratio_vs_local": round(med["memory_kept"] / med["local_kept"], 3),
        "memory_tier_kept_mapped_written_ratio": round(
            med["memory_kept_mapped_written"] / med["memory_kept_read_written"], 3
        ),
        "memory_tier_keep_s": round(kept.seconds, 3),
        "memory_tier": {"bytes": kept.nbytes, "repeats": repeats,
                        **{f"restore_{k}_s": round(v, 3) for k, v in med.items()}},
    }  # fmt: skip


def _huge_pages(mib: int, repeats: int) -> dict[str, Any]:
    """The same measurement with the memory tier on a tmpfs mounted ``huge=within_size`` (2 MiB pages), in a
    mount namespace of its own (``unshare``: root); its keys end in ``_huge_pages``. Nothing when no such
    tmpfs can be mounted here."""
    mnt = Path(tempfile.mkdtemp(prefix="rewind-bench-huge-"))  # mounted only in the child's namespace
    cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, "-m", "bench.memory_tier",
           "--mib", str(mib), "--repeats", str(repeats), "--mounted-huge", str(mnt)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"huge pages not measured: {exc}", file=sys.stderr)
        return {}
    finally:
        mnt.rmdir()
    if done.returncode:
        print(f"huge pages not measured: {(done.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return {}
    got = json.loads(done.stdout[done.stdout.index("{") :])
    return {f"{k}_huge_pages": v for k, v in got.items() if k.startswith("memory_tier")}


def _measured(mib: int, repeats: int, memory: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="rewind-bench-memory-", dir=HERE))
    os.environ.update({"REWIND_HOME": str(work / "home"), "REWIND_MEMORY_ROOT": str(memory)})
    for k in ("REWIND_CATALOG_URL", "REWIND_CHECKPOINT_ROOT", "REWIND_MEMORY_BUDGET"):
        os.environ.pop(k, None)
    try:
        return measure(mib, repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)


def _mounted_huge(mnt: Path, mib: int, repeats: int) -> int:
    """Mount the tier's tmpfs with huge pages on ``mnt``, measure, print the results as JSON."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={4 * mib}m,mode=0700", "tmpfs",
                    str(mnt)], check=True)  # fmt: skip
    try:
        print(json.dumps(_measured(mib, repeats, mnt / "tier")))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--huge-pages", action="store_true", help="also on a tmpfs with huge pages (root)")
    p.add_argument("--mounted-huge", type=Path, help=argparse.SUPPRESS)  # the child, in its own namespace
    args = p.parse_args(argv)
    if args.mounted_huge:  # the child of --huge-pages, in a mount namespace of its own
        return _mounted_huge(args.mounted_huge, args.mib, args.repeats)
    results = _measured(args.mib, args.repeats, Path("/dev/shm") / f"rewind-bench-{os.getpid()}")
    if args.huge_pages:
        results |= _huge_pages(args.mib, args.repeats)
    print(json.dumps(results, indent=2))
    out = HERE / "results.json"
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged = {k: v for k, v in merged.items() if not k.endswith("_huge_pages")}  # this run's, or none
    out.write_text(json.dumps(merged | results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
