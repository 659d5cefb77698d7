"""Worker for the chunked format under torchrun (gloo, FSDP2): ``python -m tests.chunked_sharded_worker MODE ROOT``.

``save``: a frozen embedding backbone and a trainable head (AdamW on the head only), three asynchronous
chunked saves with a training step before each; every rank then writes the full (unsharded) state it
saved to ``ROOT/expected-<rank>.pt``, and restores as below. ``restore``: on any number of ranks, the newest checkpoint
restored into a fresh model and optimizer; prints ``same`` per rank when the full state equals rank 0's
expectation bit for bit."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import SaveMode
from rewind.infra.checkpoint.sharded import ShardedCheckpointer

FULL = StateDictOptions(full_state_dict=True)
STEPS = 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Embedding(8192, 128)  # 4 MiB, frozen
        self.head = torch.nn.Linear(128, 32)


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    net.backbone.weight.requires_grad_(False)
    fully_shard(net.backbone)
    fully_shard(net.head)
    fully_shard(net)
    return net, torch.optim.AdamW(net.head.parameters(), lr=1e-2)


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 8192, (16, 8), generator=g)
    net.head(net.backbone(ids).mean(dim=1)).pow(2).mean().backward()  # type: ignore[operator]
    opt.step()
    opt.zero_grad()


def _full(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(net, options=FULL),
        "optim": get_optimizer_state_dict(net, opt, options=FULL),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _checkpointer(root: Path) -> ShardedCheckpointer:
    catalog = Catalog(f"sqlite:///{root / 'catalog.db'}") if dist.get_rank() == 0 else None
    return ShardedCheckpointer("chunked", root=root, catalog=catalog, format="chunked", mode=SaveMode.ASYNC)


def _save(root: Path) -> bool:
    net, opt = _build()
    ck = _checkpointer(root)
    for step in range(1, STEPS + 1):
        _train(net, opt, step)
        msd, osd = get_state_dict(net, opt)
        ck.save(step, {"model": msd, "optim": osd}, {"rank": dist.get_rank()})
    torch.save(_full(net, opt), root / f"expected-{dist.get_rank()}.pt")
    ck.close()
    return True


def _restore(root: Path) -> bool:
    net, opt = _build()
    _train(net, opt, 0)  # the optimizer's state exists, as in a job about to resume
    ck = _checkpointer(root)
    got = ck.restore_latest(lambda: dict(zip(("model", "optim"), get_state_dict(net, opt), strict=True)))
    assert got is not None, "nothing restored"
    step, tree, _mine = got
    set_state_dict(net, opt, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
    expected = torch.load(root / "expected-0.pt", weights_only=True)
    same = step == STEPS and _same(expected, _full(net, opt))
    ck.close()
    return same


def main(mode: str, root: str) -> None:
    dist.init_process_group("gloo")
    ok = (_save(Path(root)) if mode == "save" else True) and _restore(Path(root))
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {'same' if ok else 'DIFFERENT'}", flush=True)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
