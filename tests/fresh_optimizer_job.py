"""A 2-rank DDP job with Adam whose session saves before the optimizer's first step:
``python -m tests.fresh_optimizer_job RUN OUT STEPS SAVE_FIRST`` under torchrun. The same job is trained first
without a session (the reference), then under the session (saving at step 0 when SAVE_FIRST is 1, or ``grads``:
at step 0 with gradients already computed, as a job accumulating them would; otherwise resuming from the run's
newest checkpoint); rank 0 writes both models' weights and the session's start step."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rewind.infra.training.session import TrainingSession


def _job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(8, 16, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Gradients of a batch the first step's ``zero_grad`` throws away (the run's training is unchanged), and
    a copy of them."""
    model(torch.randn(8, 16, generator=torch.Generator().manual_seed(7))).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def main(run: str, out: str, steps: int, save_first: str) -> None:
    dist.init_process_group("gloo")
    plain, plain_opt = _job()
    for step in range(1, steps + 1):
        _step(plain, plain_opt, step)
    model, opt = _job()
    with TrainingSession(run, model=model, optimizer=opt) as s:
        start = s.start_step
        if save_first != "0" and start == 0:
            kept = _grads(model) if save_first == "grads" else []
            s.save(0)
            for p, g in zip(model.parameters(), kept, strict=bool(kept)):  # an accumulating job's gradients
                assert p.grad is not None and torch.equal(p.grad, g), "the save changed the gradients"
        for step in s.steps(steps):
            s.report(step, _step(model, opt, step))
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in plain.module.state_dict().items()}, f"{out}/plain.safetensors"
        )
        save_file(
            {k: v.contiguous() for k, v in model.module.state_dict().items()}, f"{out}/session.safetensors"
        )
        with open(f"{out}/start.json", "w") as f:
            json.dump({"start": start, "restored": s.restored_checkpoint_id is not None}, f)
    del plain, plain_opt, model, opt, s  # the DDP models' reducers freed while the group still exists
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
