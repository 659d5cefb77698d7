"""A job whose data comes from torchdata's StatefulDataLoader (shuffled, several epochs), protected by a
TrainingSession that checkpoints the loader's own state: ``python -m tests.stateful_loader_job RUN OUT STEPS``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import save_file
from torchdata.stateful_dataloader import StatefulDataLoader

from rewind.infra.training.session import TrainingSession


def _forever(loader: StatefulDataLoader) -> Iterator[Any]:
    while True:  # the first pass resumes where the restored state left off; the next ones are new epochs
        yield from loader


def main(run: str, out: str, steps: int) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x @ torch.randn(8, 1, generator=g))
    # No generator of its own: torchdata then seeds each epoch itself, and a resumed loader follows the same
    # epochs (given one, torchdata 0.11 resumes the epoch but not the epochs after it; measured).
    loader = StatefulDataLoader(data, batch_size=16, shuffle=True)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with TrainingSession(run, model=model, optimizer=opt, loader=loader, checkpoint_every=10) as s:
        batches = _forever(loader)
        for step in s.steps(steps):
            xb, yb = next(batches)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            s.report(step, loss.item())
    os.makedirs(out, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out, "final.safetensors")
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
