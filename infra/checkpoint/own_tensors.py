"""Which parts of a job may be read over a memory copy's pages, and a copy of its own for what one kept.

A part is read mapped (``rewind.infra.format.mapped``) only when its state object copies what its
``load_state_dict`` is given into tensors of its own: a ``torch.nn.Module`` loaded by torch's own code
throughout (no override of ``load_state_dict`` or ``_load_from_state_dict`` outside torch, no extra state,
no load hooks), which copies each tensor into the parameter or buffer it names. Should one still keep a
tensor it was given (the swap-tensors path), or a load be refused part-way, each parameter or buffer left
over a mapping gets a copy of its own after the load, so none keeps a memory copy's pages (nor writes
them: a first write to a mapped page costs more than the copy). What a module keeps elsewhere than its
parameters and buffers is not looked for: the conditions above leave it nothing else to keep.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

FORK_WAIT_S = 10.0  # a fork waits at most this long for parts being dropped


def copies_on_load(obj: object) -> bool:
    """Whether ``obj``'s ``load_state_dict`` copies the tensors it is given into its own: a module whose
    every submodule loads with torch's own code (``load_state_dict`` and ``_load_from_state_dict`` defined
    in torch), keeps no extra state and has no load hooks of its own (any of those may keep what it is
    given anywhere: an attribute, a dict, a numpy array)."""
    return (
        isinstance(obj, torch.nn.Module)
        and _torch_own(type(obj), "load_state_dict")
        and all(
            _torch_own(type(m), "_load_from_state_dict")
            and getattr(type(m), "set_extra_state", _EXTRA) is _EXTRA
            and not m._load_state_dict_pre_hooks
            and not m._load_state_dict_post_hooks
            for m in obj.modules()
        )
    )


_EXTRA = torch.nn.Module.set_extra_state


def _torch_own(cls: type, method: str) -> bool:
    return str(getattr(getattr(cls, method, None), "__module__", "")).startswith("torch.")


def storages(given: Any) -> frozenset[int]:
    """The storages of the tensors in a state as read that lie over a mapping (``tensorfile.over``: not
    resizable; every tensor read into memory of its own is), taken before the state is loaded (a
    swap-tensors load exchanges the given tensors' storages with the module's)."""
    return frozenset(
        t.untyped_storage().data_ptr()
        for t in _tensors(given)
        if t.numel() and not t.untyped_storage().resizable()  # made over a mapping, not allocated
    )


def own_kept(module: torch.nn.Module, handed: frozenset[int]) -> int:
    """Give ``module`` a copy of each parameter or buffer whose storage is one of ``handed`` (``storages``
    of what its ``load_state_dict`` was given); how many it kept."""
    kept = 0
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            if t.numel() and t.untyped_storage().data_ptr() in handed:
                t.data = t.data.clone()
                kept += 1
    return kept


def let_go(states: dict[str, Any]) -> None:
    """Empty ``states`` (parts as read, loaded) and drop what it held on a thread of its own: the last
    tensor over a memory copy's mapping unmaps it, and the kernel's page-table teardown (13 ms per 512 MiB
    measured here) runs beside the job's next steps instead of before them. The caller must hold no other
    reference to the parts. Where no thread can be started they are dropped here."""
    held = list(states.values())
    states.clear()
    drop = threading.Thread(target=held.clear, name="rewind-unmap", daemon=True)
    try:
        drop.start()
    except RuntimeError:  # a process limit on threads, or the interpreter shutting down
        held.clear()
        return
    _DROPPING[:] = [t for t in _DROPPING if t.is_alive()] + [drop]  # no lock: the fork hook reads it


def dropped(timeout: float = 30.0) -> bool:
    """Wait up to ``timeout`` seconds in all for the parts ``let_go`` was given to be dropped; whether they
    are. Takes no lock: it runs before every fork (``os.register_at_fork``), a signal handler's too."""
    deadline = time.monotonic() + timeout
    waiting = list(_DROPPING)
    for t in waiting:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in waiting)


_DROPPING: list[threading.Thread] = []
# A child forked while parts wait to be dropped would inherit them without the thread that drops them, and
# keep a memory copy's pages mapped for its whole life (a data loader's persistent workers): wait first.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: dropped(timeout=FORK_WAIT_S), after_in_child=_DROPPING.clear)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
