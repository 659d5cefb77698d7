"""Copy one rank's tensors of a sharded state into CPU shells that are reused from save to save.

A shell is a CPU tensor (or a DTensor whose local shard is one) shaped like the live tensor. The first
save with a given set of shapes allocates the shells (pinned when CUDA is present: one copy of this
rank's state, never more); every later save only copies into them. ``stage`` returns once the values
are in the shells (on CUDA: the copies are queued on a side stream and ``Staged.ready`` waits for them),
so a value changed after it returned never reaches the checkpoint: the copy-safety DCP's
``async_save`` of CPU tensors lacks (pytorch#144657).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, cast

import torch

from rewind.infra.checkpoint.populate import populate

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4 kept it private
    from torch.distributed._tensor import DTensor

Signature = tuple[tuple[Any, ...], ...]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True, slots=True)
class StagedShells:
    """The shells, holding the values of the call; valid until the next ``stage``."""

    tensors: dict[str, torch.Tensor]
    nbytes: int
    event: torch.cuda.Event | None = None

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class ShellStager:
    def __init__(self) -> None:
        self._shells: dict[str, torch.Tensor] = {}
        self._signature: Signature | None = None
        self._stream: torch.cuda.Stream | None = None

    @staticmethod
    def _signature_of(tensors: dict[str, torch.Tensor]) -> Signature:
        """What a shell is made from: a DTensor's placements and global shape and stride as well as its
        shard's shape (a shell reused across a change of layout would carry the old one to DCP)."""
        return tuple(
            (name, type(t).__name__, t.dtype, tuple(_local(t).shape), tuple(t.shape), t.stride(),
             tuple(getattr(t, "placements", ())))
            for name, t in tensors.items()
        )  # fmt: skip

    @staticmethod
    def _shell(t: torch.Tensor, pin: bool) -> torch.Tensor:
        local = _local(t)
        cpu = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
        if not isinstance(t, DTensor):
            return cpu
        if local.device.type == "cpu":
            return DTensor.from_local(
                cpu, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        # a DTensor of this mesh with a CPU shard (DCP stages it so), the shard pinned as DCP's own stager
        # pins it: a side-stream copy into pageable memory would be synchronous
        shell = cast(DTensor, t.detach().to("cpu"))
        shell._local_tensor = cpu
        return shell

    def _ensure(self, tensors: dict[str, torch.Tensor]) -> None:
        sig = self._signature_of(tensors)
        if sig == self._signature:
            return
        self._shells, self._signature = {}, None  # free the old shells first: never hold two copies
        pin = torch.cuda.is_available()
        self._shells = {name: self._shell(t, pin) for name, t in tensors.items()}
        self._signature = sig

    def prepare(self, tensors: dict[str, torch.Tensor]) -> None:
        """The shells for tensors shaped as ``tensors``, allocated and made resident: ``stage`` then copies
        alone (``populate``). A GPU DTensor's shell is a host copy of its shard, as DCP stages it."""
        self._ensure(tensors)
        for shell in self._shells.values():
            populate(_local(shell))

    def stage(self, tensors: dict[str, torch.Tensor]) -> StagedShells:
        """Copy ``tensors`` into the shells; the previous ``StagedShells`` must no longer be in use."""
        self._ensure(tensors)
        devices = {_local(t).device for t in tensors.values() if _local(t).is_cuda}
        if len(devices) > 1:  # one side stream per rank's device; tensors on several: copy in the stall
            return self._stage_blocking(tensors)
        on_gpu = bool(devices)
        if on_gpu and (self._stream is None or self._stream.device != next(iter(devices))):
            self._stream = torch.cuda.Stream(device=next(iter(devices)))
        if on_gpu and self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))  # the latest values
        ctx = torch.cuda.stream(self._stream) if on_gpu else contextlib.nullcontext()
        nbytes = 0
        with ctx, torch.no_grad():
            for name, t in tensors.items():
                src, dst = _local(t).detach(), _local(self._shells[name])
                dst.copy_(src, non_blocking=src.is_cuda)
                nbytes += dst.numel() * dst.element_size()
        event = None
        if on_gpu and self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            # no in-place update before the copy is done
            torch.cuda.current_stream(self._stream.device).wait_event(event)
        return StagedShells(dict(self._shells), nbytes, event)

    def _stage_blocking(self, tensors: dict[str, torch.Tensor]) -> StagedShells:
        nbytes = 0
        with torch.no_grad():
            for name, t in tensors.items():
                dst = _local(self._shells[name])
                dst.copy_(_local(t).detach())  # blocking: done when it returns
                nbytes += dst.numel() * dst.element_size()
        return StagedShells(dict(self._shells), nbytes, None)
