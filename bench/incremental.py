"""Bytes written per checkpoint, chunked format vs the plain one, in the same run (issue 14, local tier).

    .venv/bin/python -m bench.incremental [--params-m 8] [--checkpoints 5]

Two regimes, each trained and checkpointed once per format: a frozen backbone with a ~5%
trainable head (AdamW on the head only), and full training (everything changes). The figure
is bytes written per checkpoint after the first (data files written, not hard-linked, plus
the manifest), chunked over plain. The defaults fit in about a minute on 2 cores; the issue's
version (50M parameters, 20 checkpoints per regime) is the one ``make bench`` runs:
``--params-m 50 --checkpoints 20``. Writes ``incremental_bytes_ratio_frozen``,
``incremental_bytes_ratio_full`` (and the frozen regime's bytes over its trainable bytes)
to bench/results.json, and ``incremental_persist_ratio_*``: the median synchronous save
(the whole persist, fsyncs included) chunked over plain. Upload, async stall and restore
ratios are not measured yet.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from bench.run import machine
from infra.catalog.db import Catalog
from infra.checkpoint.engine import Checkpointer
from infra.format import payload

HERE = Path(__file__).resolve().parent
DIM = 256


class Net(torch.nn.Module):
    def __init__(self, params: int) -> None:
        super().__init__()
        head_out = max(1, params // 20 // DIM)  # the head is ~5% of the parameters
        self.backbone = torch.nn.Embedding(max(1, (params - head_out * DIM) // DIM), DIM)
        self.head = torch.nn.Linear(DIM, head_out)


def run_regime(work: Path, cat: Catalog, fmt: str, frozen: bool, params: int, n: int) -> dict[str, float]:
    torch.manual_seed(0)
    net = Net(params)
    net.backbone.weight.requires_grad_(not frozen)
    opt = torch.optim.AdamW(net.head.parameters() if frozen else net.parameters(), lr=1e-3)
    run = f"{'frozen' if frozen else 'full'}-{fmt}"
    ck = Checkpointer(run, states={"model": net, "optimizer": opt}, root=work, catalog=cat, format=fmt)
    written: list[int] = []
    seconds: list[float] = []
    for step in range(1, n + 1):
        ids = torch.randint(0, net.backbone.num_embeddings, (32, 16))
        loss = net.head(net.backbone(ids).mean(dim=1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds.append(ck.save(step))  # synchronous: the whole persist, fsyncs included
        assert ck.last_saved is not None
        written.append(ck.last_saved.written_bytes)
    ck.close()
    params_bytes = [p for p in net.parameters() if p.requires_grad]
    trainable = sum(p.numel() * p.element_size() for p in params_bytes)
    trainable += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return {
        "after_first": statistics.mean(written[1:]),
        "first": written[0],
        "trainable": trainable,
        "save_s": statistics.median(seconds[1:]),
    }


def measure(work: Path, params: int, n: int) -> dict[str, float]:
    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    out: dict[str, float] = {}
    for regime, frozen in (("frozen", True), ("full", False)):
        got = {fmt: run_regime(work, cat, fmt, frozen, params, n) for fmt in payload.FORMATS}
        chunked, plain = got[payload.CHUNKED], got[payload.PLAIN]
        out[f"incremental_bytes_ratio_{regime}"] = chunked["after_first"] / plain["after_first"]
        out[f"incremental_bytes_per_checkpoint_{regime}"] = chunked["after_first"]
        out[f"plain_bytes_per_checkpoint_{regime}"] = plain["after_first"]
        out[f"incremental_persist_ratio_{regime}"] = chunked["save_s"] / plain["save_s"]
        if frozen:
            out["incremental_bytes_vs_trainable_frozen"] = chunked["after_first"] / chunked["trainable"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-m", type=float, default=8.0, help="model size in millions of parameters")
    p.add_argument("--checkpoints", type=int, default=5, help="checkpoints per regime and format")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="rewind-bench-", dir=HERE))
    try:
        got = measure(work, int(args.params_m * 1e6), max(2, args.checkpoints))
    finally:
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
