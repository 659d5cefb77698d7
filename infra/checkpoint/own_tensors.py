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
from collections.abc import Iterator
from typing import Any

import torch

from rewind.infra.format import dropping


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


def targets(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers by their state dict keys, detached (written without autograd, as
    torch's own load writes them under ``no_grad``): what a proven memory copy may be loaded straight into
    (``rewind.infra.format.in_place``). Empty unless every entry is one of its own dense, contiguous CPU
    tensors of torch's own types, and under the swap-tensors load (``torch.__future__``), which exchanges
    what it is given for its tensors instead of copying it. For a module that ``copies_on_load``."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return {}
    own = {id(t) for t in itertools.chain(module.parameters(), module.buffers())}
    out: dict[str, torch.Tensor] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        if not (id(t) in own and type(t) in (torch.Tensor, torch.nn.Parameter) and _plain(t)):
            return {}
        out[key] = t.detach()
    return out


def versions(parts: dict[str, dict[str, torch.Tensor]]) -> list[int]:
    """The version counters of ``targets``' tensors, part by part: any write to them changes one."""
    return [t._version for by_key in parts.values() for t in by_key.values()]


def _plain(t: torch.Tensor) -> bool:
    """Bytes that are its values, written as torch's own copy would: on the CPU, dense and contiguous, no
    lazy conjugation or negation (a copy resolves them, a byte copy would not), not an inference tensor
    (which torch refuses to write outside inference mode)."""
    dense = t.device.type == "cpu" and t.layout is torch.strided and t.is_contiguous()
    return dense and not (t.is_conj() or t.is_neg() or t.is_inference())


def _torch_own(cls: type, method: str) -> bool:
    return str(getattr(getattr(cls, method, None), "__module__", "")).startswith("torch.")


def storages(given: Any, module: torch.nn.Module) -> frozenset[int]:
    """The storages of the tensors in a state as read for ``module`` that lie over a mapping
    (``tensorfile.over``: not resizable; every tensor read into memory of its own is), taken before the
    state is loaded (a swap-tensors load exchanges the given tensors' storages with the module's). The
    module's own storages are never among them: a state loaded in place holds the module's own tensors,
    which may not be resizable either (made by ``torch.from_numpy``, or exported to numpy by other code)."""
    own = {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())}
    return frozenset(
        ptr
        for t in _tensors(given)
        if t.numel()
        and not t.untyped_storage().resizable()  # made over a mapping, not allocated
        and (ptr := t.untyped_storage().data_ptr()) not in own
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
    """Empty ``states`` (parts as read, loaded) and drop what it held on a thread of its own
    (``dropping.later``): the last tensor over a memory copy's mapping unmaps it. The caller must hold no
    other reference to the parts."""
    held = list(states.values())
    states.clear()
    dropping.later(held.clear)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
