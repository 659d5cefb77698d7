"""A PyTorch Lightning job protected by Rewind: ``RewindCallback`` and its ``CheckpointIO``, nothing else.

    python -m rewind.examples.lightning_job --run NAME --steps N --every K --out DIR

A small regression model (a LightningModule with AdamW and a step-wise scheduler) trained on a torchdata
``StatefulDataLoader`` (shuffled), so a resume restores the position inside the epoch as well as the
model, optimizer, scheduler, the loops' progress and every random generator, and ends bit-identical to an
uninterrupted run. Writes ``DIR/final.safetensors`` (the weights) at the end. Needs the ``lightning``
and ``torchdata`` extras.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from rewind.integrations.lightning import RewindCallback


class Regressor(pl.LightningModule):
    def __init__(self, lr: float, step_time_s: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.lr, self.step_time_s = lr, step_time_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        began = time.monotonic()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        print(f"step={self.global_step + 1} loss={loss.item()!r}", flush=True)
        if (pad := self.step_time_s - (time.monotonic() - began)) > 0:
            time.sleep(pad)  # the pace of a bigger model, not synchronisation
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=g)
    return TensorDataset(x, (x.sum(dim=1, keepdim=True) * 0.3).sin())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rewind.examples.lightning_job", description=__doc__.splitlines()[0]
    )
    p.add_argument("--run", required=True)
    p.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    p.add_argument("--every", type=int, required=True, help="a Rewind checkpoint every K steps")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--step-time-s", type=float, default=0.0)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    # The sampler has a generator of its own: the loader draws each epoch's base seed from the generator it
    # is given, and torchdata restores a sampler's generator to where its epoch began, without that draw.
    ds = data(args.seed)
    order = RandomSampler(ds, generator=torch.Generator().manual_seed(args.seed))
    loader = StatefulDataLoader(ds, batch_size=16, sampler=order)
    model = Regressor(args.lr, args.step_time_s)
    rewind = RewindCallback(args.run, every_n_steps=args.every)
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        callbacks=[rewind], plugins=[rewind.checkpoint_io],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader, ckpt_path=rewind.resume_point())
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
        str(args.out / "final.safetensors"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
