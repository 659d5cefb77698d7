"""The chunked format against the plain one, in the same run (issue 14): bytes, stall, restore, upload.

    .venv/bin/python -m bench.incremental [--params-m 8] [--checkpoints 5] [--no-s3]

Two regimes, each trained and checkpointed (asynchronously, as a job would) by one job
per format, the two jobs side by side on the same batches, taking turns to save first so
that both meet the same disk and page cache: a frozen backbone with a ~5% trainable head (AdamW on the head only), and full
training (everything changes). Per checkpoint after the first two: bytes written (data
files not hard-linked, plus the manifest), the stall (what ``save()`` blocked the
loop), the whole save (stall + background persist, fsyncs included), and, in the
frozen regime, the bytes replication sent to a real S3 server (SeaweedFS on
loopback). Then the newest checkpoint restored into a fresh job (median of 3). The
defaults fit in a couple of minutes on 2 cores; the issue's version (50M parameters,
20 checkpoints per regime) is what ``make bench`` runs: ``--params-m 50 --checkpoints 20``.

Writes to bench/results.json, every ratio chunked over plain: ``incremental_bytes_ratio_*``,
``incremental_upload_ratio_frozen``, ``incremental_stall_ratio_full``,
``incremental_save_ratio_full``, ``incremental_restore_ratio`` (full regime, the one
where every byte is new), and the frozen regime's bytes and upload over its trainable
bytes (``incremental_*_vs_trainable_frozen``; <= 1.1 is the issue's bar).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.run import machine
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.drills.servers import SeaweedS3
from rewind.infra.format import manifest as mf
from rewind.infra.format import payload
from rewind.infra.replication import replicate
from rewind.infra.tiers.base import Tier
from rewind.infra.tiers.s3 import S3Tier

HERE = Path(__file__).resolve().parent
DIM = 256
# The first save has no parent to link from; the first two fill the page cache with pages the machine
# has not touched yet (on a VM, 2 s instead of 0.5 s for the same 600 MB). Steady state starts after.
WARM_UP = 2


class Net(torch.nn.Module):
    def __init__(self, params: int) -> None:
        super().__init__()
        head_out = max(1, params // 20 // DIM)  # the head is ~5% of the parameters
        self.backbone = torch.nn.Embedding(max(1, (params - head_out * DIM) // DIM), DIM)
        self.head = torch.nn.Linear(DIM, head_out)


@dataclass
class Regime:
    """What one format did in one regime, per checkpoint after the first two (the warm-up)."""

    written: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    stall: list[float] = field(default_factory=list)
    save: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)
    trainable: int = 0


def build(params: int, frozen: bool) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net(params)
    net.backbone.weight.requires_grad_(not frozen)
    opt = torch.optim.AdamW(net.head.parameters() if frozen else net.parameters(), lr=1e-3)
    return net, opt


def train(net: Net, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # the same batch for both formats' jobs
    ids = torch.randint(0, net.backbone.num_embeddings, (32, 16), generator=g)
    loss = net.head(net.backbone(ids).mean(dim=1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def trainable_bytes(net: Net, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    return n + sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())


def _checkpoint(ck: Checkpointer, cat: Catalog, step: int, tier: Tier | None, got: Regime) -> None:
    """One asynchronous save, waited for (the stall and the whole save), then replicated if ``tier``."""
    started = time.perf_counter()
    stall = ck.save(step)
    ck.wait()
    whole = time.perf_counter() - started
    saved = ck.last_saved
    assert saved is not None and saved.step == step
    sent = 0
    if tier is not None:  # data bytes sent, plus the manifest (always sent)
        sent = replicate(cat, lineage.get_checkpoint(cat, saved.checkpoint_id), tier).bytes_sent
        sent += (Path(saved.path) / mf.MANIFEST_NAME).stat().st_size
    if step > WARM_UP:
        got.stall.append(stall)
        got.save.append(whole)
        got.written.append(saved.written_bytes)
        got.sent.append(sent)


@dataclass
class Job:
    """One format's job in a regime: its model, optimizer, checkpointer and what it measured."""

    fmt: str
    run: str
    net: Net
    opt: torch.optim.Optimizer
    ck: Checkpointer
    got: Regime = field(default_factory=Regime)


def _restores(job: Job, root: Path, cat: Catalog, params: int, frozen: bool, n: int) -> None:
    """The newest checkpoint restored into a fresh job, three times; every one bit-exact."""
    for _ in range(3):
        fresh, fresh_opt = build(params, frozen)
        train(fresh, fresh_opt, 0)  # the optimizer's state exists, as in a job about to resume
        other = Checkpointer(job.run, states={"model": fresh, "optimizer": fresh_opt}, root=root, catalog=cat)
        started = time.perf_counter()
        done = other.restore_latest()
        job.got.restore.append(time.perf_counter() - started)
        other.close()
        assert done is not None and done.step == n and torch.equal(fresh.head.weight, job.net.head.weight)


def run_regime(
    work: Path, cat: Catalog, frozen: bool, params: int, n: int, tier: Tier | None
) -> dict[str, Regime]:
    """Both formats' jobs side by side, step by step, taking turns to save first (same disk, same cache)."""
    root = work / "ckpt"
    jobs = []
    for fmt in payload.FORMATS:
        net, opt = build(params, frozen)
        run = f"{'frozen' if frozen else 'full'}-{fmt}"
        states = {"model": net, "optimizer": opt}
        ck = Checkpointer(run, states=states, root=root, catalog=cat, format=fmt, mode=SaveMode.ASYNC)
        jobs.append(Job(fmt, run, net, opt, ck))
    for step in range(1, n + 1):
        for job in jobs if step % 2 else reversed(jobs):
            train(job.net, job.opt, step)
            # Keep the disk bounded, before the save: the page cache the save fills then reuses the pages
            # this frees. Deleted after the save instead, a save on a VM whose free memory the host takes
            # back (virtio balloon free page reporting) waits for fresh pages: 0.5 s or 2.5 s for the same
            # 600 MB, whatever the format, and that noise, not the format, decided the ratios.
            shutil.rmtree(root / job.run / f"step-{step - 2}", ignore_errors=True)
            _checkpoint(job.ck, cat, step, tier, job.got)
    for job in jobs:
        job.ck.close()
        job.got.trainable = trainable_bytes(job.net, job.opt)
    for i in range(2):  # restores alternate too
        for job in jobs if i % 2 == 0 else reversed(jobs):
            _restores(job, root, cat, params, frozen, n)
    return {job.fmt: job.got for job in jobs}


def _ratios(regime: str, chunked: Regime, plain: Regime) -> dict[str, float]:
    mean, med = statistics.mean, statistics.median
    out = {
        f"incremental_bytes_ratio_{regime}": mean(chunked.written) / mean(plain.written),
        f"incremental_bytes_per_checkpoint_{regime}": mean(chunked.written),
        f"plain_bytes_per_checkpoint_{regime}": mean(plain.written),
        f"incremental_stall_ratio_{regime}": med(chunked.stall) / med(plain.stall),
        f"incremental_save_ratio_{regime}": med(chunked.save) / med(plain.save),
        f"incremental_restore_ratio_{regime}": med(chunked.restore) / med(plain.restore),
        f"incremental_restore_s_{regime}": med(chunked.restore),
        f"plain_restore_s_{regime}": med(plain.restore),
    }
    if regime == "frozen":
        out["incremental_bytes_vs_trainable_frozen"] = mean(chunked.written) / chunked.trainable
        if mean(plain.sent):
            out["incremental_upload_ratio_frozen"] = mean(chunked.sent) / mean(plain.sent)
            out["incremental_upload_vs_trainable_frozen"] = mean(chunked.sent) / chunked.trainable
    return out


def measure(work: Path, params: int, n: int, tier: Tier | None) -> dict[str, float]:
    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    out: dict[str, float] = {}
    # Full training first: the S3 server's own work after the frozen regime's uploads would land on it.
    for regime, frozen in (("full", False), ("frozen", True)):
        got = run_regime(work, cat, frozen, params, n, tier if frozen else None)
        out |= _ratios(regime, got[payload.CHUNKED], got[payload.PLAIN])
    out["incremental_restore_ratio"] = out["incremental_restore_ratio_full"]
    return out


def _s3(work: Path) -> tuple[SeaweedS3, Tier]:
    server = SeaweedS3(work / "weed")
    server.start()
    os.environ.update(server.env)
    server.client().create_bucket(Bucket="bench")
    return server, S3Tier("s3://bench/incremental")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", type=float, default=8.0, help="model size in millions of parameters")
    p.add_argument("--checkpoints", type=int, default=5, help="checkpoints per regime and format")
    p.add_argument("--no-s3", action="store_true", help="skip the upload figures (no SeaweedFS)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="rewind-bench-", dir=HERE))
    server, tier = (None, None) if args.no_s3 else _s3(work)
    try:
        got = measure(work, int(args.params_m * 1e6), max(WARM_UP + 2, args.checkpoints), tier)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    for k, v in got.items():
        print(f"  {k:42} {v:14.4f}")
    out = HERE / "results.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    results |= got | {"incremental_params_m": args.params_m, "incremental_checkpoints": args.checkpoints}
    results.setdefault("machine", machine())
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
