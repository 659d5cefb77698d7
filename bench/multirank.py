"""Multi-rank checkpoint speed: Rewind's async sharded save against DCP's ``save`` and ``async_save``, on the
same ranks and the same state (FSDP-style DTensor shards, gloo on CPU), in one run.

    .venv/bin/python -m bench.multirank [--ranks 4] [--mib-per-rank 64] [--repeat 5] [--device cuda]

With ``--device cuda`` the shards live on the GPUs (one per rank, NCCL beside gloo) and the keys below
are written with a ``_cuda`` suffix (``bench/gpu_check.sh`` runs it on one GPU).

Every contender saves the same state dict in the same processes, in turn (the order alternating from
repeat to repeat), a fresh directory each time.
Figures are medians over repeats of the slowest rank (a collective save is as slow as its slowest rank):

- ``multirank_stall_ratio_vs_dcp_async``: Rewind's async stall (``save`` returned) over DCP
  ``async_save``'s (the call returned), both with DCP's defaults on the DCP side.
- ``multirank_persist_ratio_vs_dcp``: Rewind's time to durable (committed in the catalog, every file
  hashed) over DCP ``save``'s (files written and fsync'd, no digests, no catalog).
- ``multirank_peak_rss_ratio``: the growth of a rank's peak RSS over one async save (Linux ``VmHWM``, reset
  before it), over the rank's state bytes: the staging copy and the writer's buffers. Rewind's first save
  (it allocates its shells then) and DCP ``async_save``'s are both reported.
- ``multirank_chunked_bytes_vs_trainable_frozen``: the chunked format (``format="chunked"``) on the same
  ranks, one of every 16 tensors changed between saves (a frozen backbone): the pack bytes each save after
  the first wrote (not linked), over the bytes that changed. ``multirank_chunked_persist_ratio_full``: its
  time to committed over the plain format's when every tensor changed (the two alternating, median of 3).
- ``multirank_overhead_pct``: the training slowdown of a loop (matmuls and a gradient all-reduce on every
  rank) checkpointing asynchronously every N steps, N chosen so that a persist takes about a tenth of the
  interval; against the same loop without checkpoints, the two alternating (median of 3 pairs).

Writes the keys above and ``multirank`` (every figure, the machine) to bench/results.json. Run it with
nothing else running.
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
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def _state(mib: int, world: int, device: str) -> dict[str, Any]:
    """``mib`` MiB of float32 on this rank, as DTensors sharded over the world (dim 0), in 4 MiB pieces, on
    ``device`` ("cpu" or "cuda")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device, (world,))
    rows = (4 * MiB) // (4 * 256)
    g = torch.Generator().manual_seed(dist.get_rank())
    shards = {
        f"layer{i}.weight": DTensor.from_local(
            torch.randn(rows, 256, generator=g).to(device), mesh, [Shard(0)], run_check=False
        )
        for i in range(max(1, mib // 4))
    }
    return {"model": shards}


def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _sync() -> None:
    """Wait for this rank's queued GPU work (a timer must not stop while kernels are still queued)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _slowest(x: float) -> float:
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, x)
    return max(box)


def _fresh(base: Path, name: str) -> Path:
    d = base / name
    if dist.get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    return d


def _dcp_round(state: dict[str, Any], work: Path, i: int) -> tuple[float, float, float]:
    """(sync save s, async_save stall s, async_save to durable s)."""
    d = _fresh(work, f"dcp-{i}")
    _sync()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d), sync_files=True))
    sync_s = time.perf_counter() - t0
    d = _fresh(work, f"dcpa-{i}")
    dist.barrier()
    t0 = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(d), sync_files=True))
    _sync()
    stall = time.perf_counter() - t0
    # DCP's default stager is synchronous, so async_save hands back a plain Future (not an AsyncSaveResponse)
    upload = fut.upload_completion if hasattr(fut, "upload_completion") else fut
    upload.result()
    return sync_s, stall, time.perf_counter() - t0


def _rewind_round(ck: Any, state: dict[str, Any], step: int) -> tuple[float, float]:
    """(async stall s, to committed s)."""
    _sync()
    dist.barrier()
    t0 = time.perf_counter()
    ck.save(step, state, {"rank": dist.get_rank()})
    _sync()  # on a GPU: until the copies the compute stream waits for are done
    stall = time.perf_counter() - t0
    ck.wait()
    dist.barrier()  # rank 0 committed: every rank's background save ended with its outcome
    return stall, time.perf_counter() - t0


def _peak_growth(fn: Any) -> float:
    """Bytes the peak RSS grew by while ``fn`` ran."""
    before = _rss_kib("VmRSS")
    _rss_peak_reset()
    fn()
    return (_rss_kib("VmHWM") - before) * 1024.0


def _train_loop(steps: int, every: int, ck: Any, state: dict[str, Any], first_step: int) -> float:
    """Seconds for ``steps`` steps of a compute-bound loop with a gradient all-reduce; an async save every
    ``every`` steps (0: none). The state saved is the one benchmarked: its values change every step."""
    shard = next(iter(state["model"].values())).to_local()
    a, b = torch.randn(384, 384, device=shard.device), torch.randn(384, 384, device=shard.device)
    grad = torch.zeros(256 * 1024, device=shard.device)
    _sync()
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        for _ in range(6):
            a = torch.tanh(a @ b)
        dist.all_reduce(grad)
        shard.add_(1e-3)
        if every and s % every == 0:
            ck.save(first_step + s, state, {"rank": dist.get_rank()})
    if every:
        ck.wait()
    _sync()
    dist.barrier()
    return time.perf_counter() - t0


def _dcp_into(got: dict[str, list[float]], state: dict[str, Any], work: Path, i: int) -> None:
    for k, v in zip(
        ("dcp_save", "dcp_async_stall", "dcp_async_durable"), _dcp_round(state, work, i), strict=True
    ):
        got[k].append(_slowest(v))


def _rewind_into(got: dict[str, list[float]], ck: Any, state: dict[str, Any], step: int) -> None:
    for k, v in zip(("rewind_stall", "rewind_durable"), _rewind_round(ck, state, step), strict=True):
        got[k].append(_slowest(v))


def worker(args: argparse.Namespace) -> None:
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import SaveMode
    from rewind.infra.checkpoint.sharded import ShardedCheckpointer

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if args.device == "cpu" else "cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    work = Path(args.dir)
    state = _state(args.mib_per_rank, world, args.device)
    nbytes = sum(t.to_local().numel() * 4 for t in state["model"].values())
    cat = Catalog(f"sqlite:///{work / 'bench.db'}") if rank == 0 else None
    ck = ShardedCheckpointer("bench", root=work / "rewind", catalog=cat, mode=SaveMode.ASYNC)
    rss_first = _peak_growth(lambda: _rewind_round(ck, state, 1))
    rss_dcp = _peak_growth(lambda: _dcp_round(state, work, 999))
    got: dict[str, list[float]] = {k: [] for k in ("dcp_save", "dcp_async_stall", "dcp_async_durable",
                                                    "rewind_stall", "rewind_durable")}  # fmt: skip
    for i in range(args.repeat):  # the order alternates, so neither side inherits the other's writeback
        rounds = [lambda i=i: _dcp_into(got, state, work, i), lambda i=i: _rewind_into(got, ck, state, 2 + i)]
        for fn in rounds if i % 2 == 0 else rounds[::-1]:
            fn()
        if rank == 0:
            for p in work.glob("dcp*-*"):
                shutil.rmtree(p, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    every = max(1, round(10 * med["rewind_durable"] / _step_time(work, ck, state)))
    steps = every * args.checkpoints
    pairs = []  # plain and saving loops alternate: this machine's pace drifts more than the overhead
    for k in range(args.overhead_pairs):
        plain = _slowest(_train_loop(steps, 0, ck, state, 0))
        pairs.append((plain, _slowest(_train_loop(steps, every, ck, state, 100 + k * steps))))
    overheads = sorted(100.0 * (saving / plain - 1.0) for plain, saving in pairs)
    chunked = _chunked_figures(work, state, cat, ck)
    ck.close()
    out = {
        "ranks": world,
        "device": args.device,
        "state_mib_per_rank": nbytes / MiB,
        **{f"{k}_s": v for k, v in med.items()},
        "rewind_first_save_rss_growth_ratio": _slowest(rss_first) / nbytes,
        "dcp_async_rss_growth_ratio": _slowest(rss_dcp) / nbytes,
        "checkpoint_every_steps": every,
        "train_plain_s": statistics.median(p for p, _ in pairs),
        "train_with_async_saves_s": statistics.median(sv for _, sv in pairs),
        "overhead_pct_each_pair": overheads,
        "overhead_pct_median": statistics.median(overheads),
        **chunked,
    }
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _written_pack_bytes(step_dir: Path) -> int:
    """Pack bytes of a just-committed checkpoint that it wrote itself (not hard links to earlier ones)."""
    from rewind.infra.format import manifest as mf

    packs = [e for e in mf.read(step_dir).files if e.path.startswith("packs/")]
    return sum(e.size for e in packs if (step_dir / e.path).stat().st_nlink == 1)


def _chunked_figures(work: Path, state: dict[str, Any], cat: Any, plain: Any) -> dict[str, float]:
    """The chunked format's bytes with a frozen backbone, and its persist time against ``plain``'s."""
    from rewind.infra.checkpoint.engine import SaveMode
    from rewind.infra.checkpoint.sharded import ShardedCheckpointer

    ck = ShardedCheckpointer(
        "chunked", root=work / "rewind", catalog=cat, mode=SaveMode.ASYNC, format="chunked"
    )
    shards = [t.to_local() for t in state["model"].values()]
    changed = shards[::16]
    trainable = sum(t.numel() * 4 for t in changed) * dist.get_world_size()
    ratios = []
    for step in range(1, 5):
        for t in changed:
            t.add_(1e-3)
        _rewind_round(ck, state, step)
        if step > 1 and dist.get_rank() == 0:
            ratios.append(_written_pack_bytes(work / "rewind" / "chunked" / f"step-{step}") / trainable)
    times: dict[str, list[float]] = {"chunked": [], "plain": []}
    for i in range(3):
        for name, c in [("plain", plain), ("chunked", ck)][:: 1 if i % 2 == 0 else -1]:
            for t in shards:
                t.add_(1e-3)
            times[name].append(_slowest(_rewind_round(c, state, 1000 + 2 * i + (name == "chunked"))[1]))
    ck.close()
    box: list[Any] = [statistics.median(ratios) if ratios else 0.0]
    dist.broadcast_object_list(box, src=0)
    return {
        "chunked_bytes_vs_trainable_frozen": box[0],
        "chunked_durable_full_s": statistics.median(times["chunked"]),
        "plain_durable_full_s": statistics.median(times["plain"]),
    }


def _step_time(work: Path, ck: Any, state: dict[str, Any]) -> float:
    """Seconds per step of the loop, warmed up (the first steps set up kernels and the collective's
    communicator: on a GPU they take longer than hundreds of later ones), over at least ~0.5 s."""
    _train_loop(20, 0, ck, state, 0)
    steps = 20
    while (took := _slowest(_train_loop(steps, 0, ck, state, 0))) < 0.5:
        steps *= 4
    return took / steps


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.multirank", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib-per-rank", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--checkpoints", type=int, default=3, help="async saves in each overhead loop")
    p.add_argument("--overhead-pairs", type=int, default=3, help="plain and saving loops, alternating")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the state lives: cuda runs NCCL beside gloo, one GPU per rank; its figures "
                        "go under the keys' _cuda names")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        raw = Path(tmp) / "figures.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", "--standalone",
               "-m", "bench.multirank", "--worker", "--dir", tmp, "--out", str(raw),
               "--mib-per-rank", str(args.mib_per_rank), "--repeat", str(args.repeat),
               "--checkpoints", str(args.checkpoints), "--overhead-pairs", str(args.overhead_pairs),
               "--device", args.device]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "REWIND_CATALOG_URL": "", "REWIND_HOME": tmp}
        subprocess.run(cmd, check=True, cwd=HERE.parent, env=env)
        fig = json.loads(raw.read_text())
    _report(fig)


def _report(fig: dict[str, Any]) -> None:
    results = {
        "multirank_stall_ratio_vs_dcp_async": fig["rewind_stall_s"] / fig["dcp_async_stall_s"],
        "multirank_persist_ratio_vs_dcp": fig["rewind_durable_s"] / fig["dcp_save_s"],
        "multirank_peak_rss_ratio": fig["rewind_first_save_rss_growth_ratio"],
        "multirank_overhead_pct": fig["overhead_pct_median"],
        "multirank_chunked_bytes_vs_trainable_frozen": fig["chunked_bytes_vs_trainable_frozen"],
        "multirank_chunked_persist_ratio_full": fig["chunked_durable_full_s"] / fig["plain_durable_full_s"],
    }
    for k, v in sorted({**fig, **results}.items()):
        print(f"{k:42s} {v:.4g}" if isinstance(v, float) else f"{k:42s} {v}")
    suffix = "_cuda" if fig["device"] == "cuda" else ""
    machine = f"{os.cpu_count()} cores" + (f", {torch.cuda.get_device_name(0)}" if suffix else "")
    out = HERE / "results.json"
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged.update({k + suffix: v for k, v in results.items()})
    merged["multirank" + suffix] = {**fig, "machine": machine, "torch": torch.__version__}
    out.write_text(json.dumps(merged, indent=1, sort_keys=True, default=str) + "\n")


if __name__ == "__main__":
    main()
