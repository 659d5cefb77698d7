"""The process group, smoke-tested before a launch's first step: every rank all-reduces a small tensor
over the new group and checks the sum, so a group that formed but cannot carry a collective (a
mis-wired interface, a peer that joined and froze) is found before training resumes, where it is
cheap to say what failed, rather than as a hang at the first gradient.

The time from the launch to the moment every rank's group passed is the launch's topology rebuild
time (``group_ready_s`` on the incident of a relaunch). The ``group.smoke`` fault point lets a test
fail it for real.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rewind.infra.errors import RewindError
from rewind.infra.faults import fault_point


class GroupBroken(RewindError):
    """The process group formed but failed its smoke test: no step may run on it."""


def smoke_test() -> None:
    """Collective: all-reduce ``rank + 1`` over the default group and check the sum on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        fault_point("group.smoke")
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([float(rank + 1)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        got, want = float(t.item()), world * (world + 1) / 2
    except Exception as exc:  # a collective that raised: the group cannot carry training
        raise GroupBroken(f"rank {rank}: the process group failed its smoke test: {exc}") from exc
    if got != want:
        raise GroupBroken(f"rank {rank}: the process group's all-reduce gave {got}, not {want}")
