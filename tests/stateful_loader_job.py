"""A job whose data comes from torchdata's StatefulDataLoader (shuffled, several epochs), protected by a
TrainingSession that checkpoints the loader's own state: ``python -m tests.stateful_loader_job RUN OUT STEPS``.
Under torchrun each rank reads its share through a ``StatefulDistributedSampler`` and the loader's state
is the rank's own (DDP model; rank 0 writes the weights)."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from rewind.infra.training.session import TrainingSession


class Epoch:
    """The epoch a distributed sampler shuffles for (checkpointed: the sampler keeps only its position)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.n = sampler, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = int(state["epoch"])
        self.sampler.set_epoch(self.n)


def _forever(loader: StatefulDataLoader, epoch: Epoch | None) -> Iterator[Any]:
    while True:  # the first pass resumes where the restored state left off; the next ones are new epochs
        yield from loader
        if epoch is not None:
            epoch.n += 1
            epoch.sampler.set_epoch(epoch.n)


def main(run: str, out: str, steps: int) -> None:
    distributed = "LOCAL_RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x @ torch.randn(8, 1, generator=g))
    epoch = Epoch(StatefulDistributedSampler(data, shuffle=True, seed=3)) if distributed else None
    # No generator of its own: torchdata then seeds each epoch itself, and a resumed loader follows the same
    # epochs (given one, torchdata 0.11 resumes the epoch but not the epochs after it; measured).
    if epoch is not None:
        loader = StatefulDataLoader(data, batch_size=16, sampler=epoch.sampler)
    else:
        loader = StatefulDataLoader(data, batch_size=16, shuffle=True)
    model: torch.nn.Module = torch.nn.Linear(8, 1)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    states = {"epoch": epoch} if epoch is not None else {}
    with TrainingSession(
        run, model=model, optimizer=opt, loader=loader, states=states, checkpoint_every=10
    ) as s:
        if s.start_step and (not distributed or dist.get_rank() == 0):
            print(f"resumed at step {s.start_step}", flush=True)
        batches = _forever(loader, epoch)
        for step in s.steps(steps):
            xb, yb = next(batches)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            s.report(step, loss.item())
    if not distributed or dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        weights = getattr(model, "module", model).state_dict()
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "final.safetensors"))
    if distributed:  # the DDP model and its reducer freed while the group still exists (as tiny_lm_ddp)
        del model, opt, s
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--"]
    main(args[0], args[1], int(args[2]))
