"""A training script of your own, protected by Rewind through the session API alone.

    python examples/any_job.py CONFIG.json                 # one process
    torchrun --nproc-per-node 2 examples/any_job.py CONFIG.json   # DDP (FSDP2 with "fsdp": true)

Nothing here is shaped for Rewind: the configuration is a JSON file, the log lines
are this script's own, and Rewind never reads either. What Rewind does (restore,
progress, NaN detection, checkpoints, the learning-rate scale and the data window to
skip after a rebuild) happens through ``TrainingSession``. Under a supervisor the
job is started from its spec; by hand it works the same, unsupervised.

Config keys: run, steps, checkpoint_every, batch (per rank), lr, seed, out (a
directory for final.safetensors), fsdp, step_time_s (extra seconds per step: the
work of a bigger model), checkpoint_format ("plain", the default, or "chunked"), and
three test seams: poison (a sample index whose loss becomes NaN), sample_log (a
directory: the samples each rank took, per step) and diverge_lr (a factor on the learning rate
after a restore: a comeback that is not what the run was).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import Dataset

from rewind.infra.training.data import ResumableLoader
from rewind.infra.training.session import TrainingSession


class Regression(Dataset):
    """y = x @ w + noise, fixed by the seed: the same samples on every machine."""

    def __init__(self, n: int = 4096, dim: int = 32, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def _setup(cfg: dict[str, Any]) -> tuple[torch.nn.Module, torch.device, int, int]:
    distributed = "RANK" in os.environ  # started by torchrun, even on one rank
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(cfg["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    if distributed and cfg.get("fsdp"):
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.4 and 2.5 (pyproject's floor): FSDP2 lived here
            from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        model = fully_shard(model)
    elif distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None
        )
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    return model, device, rank, world


def main(path: str) -> int:
    cfg = json.loads(Path(path).read_text())
    model, device, rank, world = _setup(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    loader = ResumableLoader(Regression(), cfg["batch"], seed=cfg["seed"], rank=rank, world=world)
    with TrainingSession(cfg["run"], model=model, optimizer=opt, loader=loader,
                         checkpoint_every=cfg["checkpoint_every"],
                         format=cfg.get("checkpoint_format", "plain")) as s:  # fmt: skip
        for g in opt.param_groups:  # the rate for this many ranks (1.0 unless the job was rebuilt smaller)
            g["lr"] = cfg["lr"] * s.handoff.lr_scale * (cfg.get("diverge_lr", 1.0) if s.start_step else 1.0)
        s.note(lr=opt.param_groups[0]["lr"], world_size=world, global_batch=cfg["batch"] * world)
        batches = iter(loader)
        for it in s.steps(cfg["steps"]):
            x, y, idx = next(batches)
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            if cfg.get("poison") is not None and cfg["poison"] in idx.tolist():
                loss = loss * float("nan")  # a bad sample: the session stops the job at this step
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            _log_samples(cfg, rank, world, it, idx)
            if rank == 0 and it % 10 == 0:
                print(f"[any_job] it {it} | mse {loss.item():.5f}", flush=True)
            s.report(it, loss.item())
            time.sleep(cfg.get("step_time_s", 0))  # stands for the real work of a bigger model
    _write_final(cfg, model, rank)
    if dist.is_initialized():
        dist.barrier()  # every rank done before any tears the group down (gloo aborts on a vanished peer)
        dist.destroy_process_group()
    return 0


def _log_samples(cfg: dict[str, Any], rank: int, world: int, it: int, idx: torch.Tensor) -> None:
    if cfg.get("sample_log"):
        with open(Path(cfg["sample_log"]) / f"rank-{rank}.log", "a") as f:
            launch = os.environ.get("REWIND_LAUNCH_ID")  # which launch took them (a relaunch repeats steps)
            f.write(
                json.dumps({"step": it, "world": world, "launch": launch, "samples": idx.tolist()}) + "\n"
            )


def _write_final(cfg: dict[str, Any], model: torch.nn.Module, rank: int) -> None:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        out = Path(cfg["out"])
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}, str(out / "final.safetensors")
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
