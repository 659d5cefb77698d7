"""Ranks of a plain DCP job (gloo on CPU): the job saves a checkpoint the way any DCP user does, rank 0
adopts it through Rewind, then every rank restores it into a fresh model; rank 0 writes both for comparison."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    return torch.nn.parallel.DistributedDataParallel(model)


def main(directory: str, run: str) -> None:
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.inventory.adopt import adopt
    from rewind.infra.restore.foreign import load_dcp

    faulthandler.dump_traceback_later(120, exit=True)  # a hung rank says where, well within the test's 180 s
    dist.init_process_group("gloo")
    saved = _model(0)
    dcp.save({"model": saved.state_dict()}, checkpoint_id=directory)
    dist.barrier()
    if dist.get_rank() == 0:
        adopt(Catalog(), Path(directory), run=run)
    dist.barrier()
    fresh = _model(123)  # different weights until the restore
    state = {"model": fresh.state_dict()}
    assert load_dcp(state, run=run) == 5
    fresh.load_state_dict(state["model"])
    if dist.get_rank() == 0:
        for name, model in (("save", saved), ("load", fresh)):
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()}, f"{directory}-{name}.safetensors"
            )
    dist.barrier()
    dist.destroy_process_group()
    # Exit while the models are still referenced: freeing a DDP model's reducer after the group is gone
    # has hung a rank in C code (seen in CI: rank 1 stuck at the return from main for 120 s).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
