"""Snapshot tensors into one reusable CPU buffer, so training can go on while it is written.

The buffer is allocated once (pinned when CUDA is present) and reused while the
set of tensors keeps its shapes and dtypes, so the extra memory is bounded by one
copy of the state. For CUDA tensors the copies run on a side stream: the CPU
does not wait for them; the training stream waits (on the GPU) before its next
kernel, and the writer waits for the copy-done event before reading the buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

Parts = Mapping[str, Mapping[str, torch.Tensor]]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


@dataclass(frozen=True, slots=True)
class Staged:
    """Copies of the tensors, valid until the next ``stage``; ``ready()`` blocks until copies landed."""

    parts: dict[str, dict[str, torch.Tensor]]
    event: torch.cuda.Event | None = None

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class StagingBuffer:
    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._signature: tuple | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def _ensure(self, parts: Parts) -> torch.Tensor:
        sig = tuple((p, n, t.dtype, tuple(t.shape)) for p, ts in parts.items() for n, t in ts.items())
        if sig == self._signature and self._buf is not None:
            return self._buf
        total = sum(_align(_nbytes(t)) for ts in parts.values() for t in ts.values())
        pin = torch.cuda.is_available()
        self._buf = None  # free the old one first: never hold two copies
        self._buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        self._signature = sig
        return self._buf

    def stage(self, parts: Parts) -> Staged:
        """Copy ``parts`` into the buffer; the previous ``Staged`` must no longer be in use."""
        buf = self._ensure(parts)
        on_gpu = any(t.is_cuda for ts in parts.values() for t in ts.values())
        event = None
        if on_gpu and self._stream is None:
            self._stream = torch.cuda.Stream()
        out: dict[str, dict[str, torch.Tensor]] = {}
        offset = 0
        ctx = torch.cuda.stream(self._stream) if on_gpu else contextlib.nullcontext()
        if on_gpu and self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())  # see the latest values
        with ctx, torch.no_grad():
            for part, tensors in parts.items():
                staged: dict[str, torch.Tensor] = {}
                for name, t in tensors.items():
                    n = _nbytes(t)
                    dst = (
                        buf[offset : offset + n].view(t.dtype).view(t.shape)
                        if n
                        else torch.empty(t.shape, dtype=t.dtype)
                    )
                    if n:
                        dst.copy_(t.detach(), non_blocking=t.is_cuda)
                    staged[name] = dst
                    offset += _align(n)
                out[part] = staged
        if on_gpu:
            event = torch.cuda.Event()
            event.record(self._stream)
            torch.cuda.current_stream().wait_event(event)  # no in-place update before the copy is done
        return Staged(out, event)
