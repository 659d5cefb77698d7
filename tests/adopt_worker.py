"""Ranks of a plain DCP job (gloo on CPU): ``save`` writes a checkpoint the way any DCP user does, ``load``
restores an adopted one through Rewind into a fresh model; rank 0 writes what it holds for comparison."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file


def main(mode: str, directory: str, run: str) -> None:
    from infra.restore.foreign import load_dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0 if mode == "save" else 123)  # a load starts from different weights
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    model = torch.nn.parallel.DistributedDataParallel(model)
    state = {"model": model.state_dict()}
    if mode == "save":
        dcp.save(state, checkpoint_id=directory)
    else:
        assert load_dcp(state, run=run) == 5
        model.load_state_dict(state["model"])
    if rank == 0:
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()}, f"{directory}-{mode}.safetensors"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    os._exit(0)
