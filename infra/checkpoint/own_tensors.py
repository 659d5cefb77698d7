"""Which parts of a job may be read over a memory copy's pages, and a copy of its own for what one kept.

A part is read mapped (``rewind.infra.format.mapped``) only when its state object copies what its
``load_state_dict`` is given into tensors of its own: a ``torch.nn.Module`` none of whose submodules keeps
an extra state (``set_extra_state`` may keep anything). A module can still keep a tensor it was given
(``load_state_dict(assign=True)`` in an override, the swap-tensors path): after the load, any parameter or
buffer whose storage is one the restore handed it gets a copy of its own, so no mapped page is kept (nor
written: a first write to one costs more than the copy).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch


def copies_on_load(obj: object) -> bool:
    """Whether ``obj``'s ``load_state_dict`` copies the tensors it is given into its own."""
    if not isinstance(obj, torch.nn.Module):
        return False
    base = torch.nn.Module.set_extra_state
    return all(getattr(type(m), "set_extra_state", base) is base for m in obj.modules())


def storages(given: Any) -> frozenset[int]:
    """The storages of the tensors in a state as read, taken before it is loaded (a swap-tensors load
    exchanges the given tensors' storages with the module's)."""
    return frozenset(t.untyped_storage().data_ptr() for t in _tensors(given) if t.numel())


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


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
