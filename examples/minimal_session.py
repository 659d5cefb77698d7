"""The README's first snippet, complete: a training loop protected by ``TrainingSession``.

    python examples/minimal_session.py RUN OUT_DIR [STEPS]             # one process
    torchrun --nproc-per-node 2 examples/minimal_session.py RUN OUT_DIR # DDP on gloo

Kill it at any moment and start it again: it resumes after its newest checkpoint that proves itself.
"""

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rewind import ResumableLoader, TrainingSession


def main(run: str, out: str, steps: int) -> None:
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x @ torch.randn(16, 1, generator=g))
    model = torch.nn.Linear(16, 1)
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    base_lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=base_lr)

    loader = ResumableLoader(
        dataset, batch_size=16, seed=0, rank=rank, world=world
    )  # position is checkpointed
    with TrainingSession(run, model=model, optimizer=opt, loader=loader, checkpoint_every=20) as s:
        for group in opt.param_groups:
            group["lr"] = base_lr * s.handoff.lr_scale  # after a rebuild on fewer ranks: the scaled rate
        if s.start_step and rank == 0:
            print(f"resumed {run} after step {s.start_step}", flush=True)
        batches = iter(loader)
        for step in s.steps(steps):  # resumes after the newest checkpoint that proves itself
            xb, yb = next(batches)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            s.report(step, loss.item())  # progress for the supervisor, NaN/spike check, saves when due
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        weights = (model.module if dist.is_initialized() else model).state_dict()
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "final.safetensors"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 200)
