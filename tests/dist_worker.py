"""Worker processes for the multi-rank checkpoint tests (gloo on CPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)
    )


def _wrap(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    return torch.nn.parallel.DistributedDataParallel(model)


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, gathered, flattened to name -> tensor."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model/{k}": v.detach().clone() for k, v in msd.items()}
    for name, st in osd.get("state", {}).items():  # full state dicts land on rank 0 only
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                flat[f"optim/{name}/{k}"] = (
                    v.detach().clone().reshape(-1) if v.dim() == 0 else v.detach().clone()
                )
    return flat


def init_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Give the optimizer its state to load into: one zero-gradient step with lr 0 changes no parameter
    (the learning rates are put back after it)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    opt.zero_grad()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr


def main(mode: str, kind: str, workdir: str) -> None:
    from rewind.infra.checkpoint import sharded, sharded_load
    from rewind.infra.format import manifest as mf

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrap(_model(), kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = Path(workdir)
    if mode == "save":
        for step in range(3):
            torch.manual_seed(100 + rank * 10 + step)
            model(torch.randn(4, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        sharded.save(
            root / "ckpt",
            "dist",
            3,
            sharded.share_of({"model": msd, "optim": osd}, {"rank": rank, "consumed": 3 * 4 * world}, rank),
            layout=sharded.layout_of(world),
        )
        full = _full(model, opt)
        if rank == 0:
            save_file(full, str(root / "expected.safetensors"))
    else:
        init_optimizer_state(model, opt)
        msd, osd = get_state_dict(model, opt)
        directory = root / "ckpt" / "step-3"
        restored, mine = sharded_load.load(directory, mf.read(directory), {"model": msd, "optim": osd})
        set_state_dict(model, opt, model_state_dict=restored["model"], optim_state_dict=restored["optim"])
        full = _full(model, opt)
        if rank == 0:
            save_file(full, str(root / f"loaded-{world}.safetensors"))
            (root / f"rank-state-{world}.txt").write_text(repr(mine))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # before the DDP model is freed after its group is gone (that has hung a rank)


if __name__ == "__main__":
    main(*sys.argv[1:4])
