"""Snapshot tensors into one reusable CPU buffer, so training can go on while it is written.

The buffer is allocated once (pinned when CUDA is present) and reused while the
set of tensors keeps its shapes and dtypes, so the extra memory is bounded by one
copy of the state (and a page per part). Each part's tensors lie as they will in its
file (``tensorfile.file_order``, back to back, from a page boundary), so the direct
writer sends them to the disk from the buffer itself, without copying them again.
For CUDA tensors the copies run on a side stream of their device: the CPU does not
wait for them; the training stream waits (on the GPU) before its next kernel, and the
writer waits for the copy-done event before reading the buffer. Tensors on several
devices are copied in the stall.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from rewind.infra.checkpoint.populate import populate
from rewind.infra.format import pages, tensorfile

Parts = Mapping[str, Mapping[str, torch.Tensor]]
T = TypeVar("T")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _page(n: int) -> int:
    return -(-n // tensorfile.PAGE) * tensorfile.PAGE


def _places(parts: Parts) -> tuple[dict[tuple[str, str], int], int]:
    """Where each non-empty tensor goes in the buffer, and the bytes it needs: each part from a page
    boundary, its tensors back to back in file order (each aligned to its element size, as in the file)."""
    at: dict[tuple[str, str], int] = {}
    end = 0
    for part, tensors in parts.items():
        end = _page(end)
        for name in tensorfile.file_order(tensors):
            n = _nbytes(tensors[name])
            if n:
                at[part, name] = end
                end += n
    return at, end


def _views(
    parts: Parts, at: dict[tuple[str, str], int], buf: torch.Tensor
) -> dict[str, dict[str, torch.Tensor]]:
    """Each tensor's place in ``buf`` (``_places``), shaped as the tensor; an empty tensor a new one."""
    views: dict[str, dict[str, torch.Tensor]] = {}
    for part, tensors in parts.items():
        views[part] = {}
        for name, t in tensors.items():
            n = _nbytes(t)
            views[part][name] = (
                buf[at[part, name] : at[part, name] + n].view(t.dtype).view(t.shape)
                if n
                else torch.empty(t.shape, dtype=t.dtype)
            )
    return views


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
        self._views: dict[str, dict[str, torch.Tensor]] = {}  # each tensor's place in the buffer, made once
        self._signature: tuple | None = None
        self._stream: torch.cuda.Stream | None = None
        self._derived: tuple[object, object] | None = None  # (key, value) made from the buffer: ``derived``

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def _ensure(self, parts: Parts) -> torch.Tensor:
        sig = tuple(
            (p, tuple((n, t.dtype, tuple(t.shape)) for n, t in ts.items())) for p, ts in parts.items()
        )
        if sig == self._signature and self._buf is not None:
            return self._buf
        at, total = _places(parts)
        pin = torch.cuda.is_available()
        had = self._buf is not None
        self._buf, self._views, self._signature = None, {}, None  # the old one freed first: never two copies
        self._derived = None
        if pin and had:
            _unpin_freed()
        whole = (  # huge pages where they can be asked for: fewer to pin when the direct writer sends them
            torch.empty(total + tensorfile.PAGE, dtype=torch.uint8, pin_memory=True)
            if pin
            else pages.empty([total + tensorfile.PAGE], torch.uint8)
        )
        start = -whole.data_ptr() % tensorfile.PAGE  # the first part on a page boundary, like the rest
        self._buf = whole[start : start + max(total, 1)]
        self._views = _views(parts, at, self._buf)
        self._signature = sig
        return self._buf

    def prepare(self, parts: Parts) -> None:
        """The buffer for tensors shaped as ``parts``, allocated and made resident (nothing copied): the
        first copy into fresh memory faults in each page (1 s for 607 MB here, a VM's first touch of its
        memory included), which ``stage`` then need not."""
        populate(self._ensure(parts))

    def places(self, parts: Parts) -> dict[str, dict[str, torch.Tensor]]:
        """Where ``stage`` would copy each tensor of ``parts`` (the buffer made for them first), for a
        caller that copies them itself (``stall_hash.stage_and_hash``); the previous ``Staged`` must no
        longer be in use."""
        self._ensure(parts)
        return {part: dict(views) for part, views in self._views.items()}

    def derived(self, key: object, make: Callable[[], T]) -> T:
        """What ``make`` makes from the buffer as it is now (addresses in it, views of it), kept for calls
        with an equal ``key`` until another key or a new buffer (one value at a time, dropped with the
        buffer it describes)."""
        if self._derived is not None and self._derived[0] == key:
            return self._derived[1]  # type: ignore[return-value]  # made by ``make`` for this key
        self._derived = None
        value = make()
        self._derived = (key, value)
        return value

    def stage(self, parts: Parts) -> Staged:
        """Copy ``parts`` into the buffer; the previous ``Staged`` must no longer be in use. CUDA tensors on
        one device are copied on a side stream of that device (not the current device's: a model placed on
        ``cuda:1`` without ``set_device``); tensors on several devices (a model spread over GPUs in one
        process) are copied in the stall, since one event cannot say when copies on two devices landed."""
        self._ensure(parts)
        devices = {t.device for ts in parts.values() for t in ts.values() if t.is_cuda}
        if len(devices) > 1:
            return self._stage_blocking(parts)
        on_gpu = bool(devices)
        if on_gpu and (self._stream is None or self._stream.device != next(iter(devices))):
            self._stream = torch.cuda.Stream(device=next(iter(devices)))
        ctx = torch.cuda.stream(self._stream) if on_gpu else contextlib.nullcontext()
        if on_gpu and self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))  # the latest values
        with ctx:
            out = self._copy(parts, behind=True)
        event = None
        if on_gpu and self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            # no in-place update before the copy is done
            torch.cuda.current_stream(self._stream.device).wait_event(event)
        return Staged(out, event)

    def _stage_blocking(self, parts: Parts) -> Staged:
        return Staged(self._copy(parts, behind=False), None)  # every copy done when it returns

    def _copy(self, parts: Parts, *, behind: bool) -> dict[str, dict[str, torch.Tensor]]:
        """``parts`` copied into their places; ``behind``: CUDA copies queued (on the current stream)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for part, tensors in parts.items():
                staged = self._views[part]
                for name, t in tensors.items():
                    if t.numel():
                        staged[name].copy_(t.detach(), non_blocking=behind and t.is_cuda)
                out[part] = dict(staged)
        return out


def _unpin_freed() -> None:
    """Give the pinned memory freed back to the system: CUDA's caching host allocator keeps a freed block
    for reuse, and a larger buffer cannot use it (two copies of the state pinned after a
    layout change). Only blocks no tensor uses are freed; a build without it keeps its cache."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
