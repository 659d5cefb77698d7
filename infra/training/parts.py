"""Stateful parts for distributed jobs: models and optimizers through DCP's state-dict API, RNG per rank.

``get_model_state_dict``/``set_model_state_dict`` see through DDP and FSDP2
wrappers and keep sharded tensors sharded, so a checkpoint saved by W ranks
loads into W' ranks. DCP gives an optimizer without state its state (a
zero-learning-rate step: Adam's step count then starts at 1) when a state dict
is asked for: at a restore, which loads the saved state over it, and at a save
before the optimizer's first step, after which the session lets that state go
again (``forget``) and records the optimizer as fresh (``FRESH`` in the rank's
state), so that neither the run nor a run resumed from that checkpoint differs
from one never saved.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rewind.infra.health.layout import Layout, ModelShape


class ModelPart:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
FRESH = "fresh_optimizers"  # in a rank's saved state: the parts saved before their optimizer's first step


class OptimizerPart:
    """Saved flat (``state.<fqn>.<name>``, ``param_groups.<fqn>.<name>``): every parameter keeps its own
    hyperparameters, so pipeline stages' states merge into one. The tensors' names are the same as the
    nested form's (``state`` / FQN / name), so a checkpoint saved nested before loads too."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.stepped = False  # a step taken since: a stateless optimizer (SGD without momentum) is not fresh
        self._hook = optimizer.register_step_post_hook(self._step_taken)

    def _step_taken(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.stepped = True

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=FLAT)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        nested = isinstance(state.get("state"), dict) or isinstance(state.get("param_groups"), list)
        set_optimizer_state_dict(self.model, self.optimizer, state, options=None if nested else FLAT)

    def fresh(self) -> bool:
        """Whether the optimizer has no state, has taken no step here and has a parameter to train (DCP's state
        dict would give it state by a zero-lr step); gradients already computed do not matter (``fresh_kept``
        sets them aside). One with nothing to train, a frozen stage's, is never fresh: no step would give it
        state, and its rank's record must not wipe a resharded restore's; nor is a stateless one once it
        stepped (its gradients are then never set aside, nor a copy of them made at each save)."""
        return not (self.optimizer.state or self.stepped) and any(p.requires_grad for p in self.params())

    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def forget(self) -> None:
        """The optimizer as it was before its first step: the state DCP gave it (by a step) let go."""
        self.optimizer.state.clear()
        self.stepped = False


@contextlib.contextmanager
def fresh_kept(parts: Mapping[str, Any]) -> Iterator[list[str]]:
    """The names of the optimizer parts that have taken no step; inside, their state dicts may be asked for
    (DCP gives them state by a zero-lr step), and that state is let go on the way out, whatever happened.

    Their parameters' gradients are set aside inside and put back after: DCP takes no step where one has a
    gradient (a job accumulating them saved between micro-batches), and the checkpoint would then lack the
    optimizer state that a fresh job's restore asks for."""
    fresh = [name for name, part in parts.items() if isinstance(part, OptimizerPart) and part.fresh()]
    grads = {id(p): (p, p.grad) for name in fresh for p in parts[name].params()}
    try:
        for p, _ in grads.values():
            p.grad = None
        yield fresh
    finally:
        for name in fresh:
            parts[name].forget()
        for p, grad in grads.values():
            p.grad = grad


def rank_state(fresh: list[str]) -> dict[str, Any]:
    """This rank's own state as a sharded save keeps it: its generators, and the optimizers saved fresh."""
    return {"rng": RankRNG().state_dict(), FRESH: fresh}


def load_rank_state(parts: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """A rank's own state restored, once its parts are loaded: its generators, and each optimizer saved before
    its first step as fresh as it was (an older checkpoint records none)."""
    for name in mine.get(FRESH, ()):
        part = parts.get(name)
        if isinstance(part, OptimizerPart):
            part.forget()
    RankRNG().load_state_dict(mine["rng"])


def job_layout(given: Layout | None, handed: Layout | None, model: Any, world: int) -> Layout | None:
    """The layout recorded with each checkpoint: as the job says, else as it was handed (for this world
    size), else TP as the model's device mesh shows it; None: data-parallel."""
    fits = handed if handed is not None and handed.world_size == world else None
    return given or fits or mesh_layout(model, world)


def mesh_layout(part: Any, world: int) -> Layout | None:
    """TP as the model's parameters show it (a DTensor device mesh with a dimension named ``tp``); None
    where no parameter is tensor-parallel. Pipeline stages do not show in a parameter: the job says PP."""
    model = getattr(part, "model", part)
    for param in model.parameters() if isinstance(model, torch.nn.Module) else ():
        mesh = getattr(param, "device_mesh", None)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh is not None and "tp" in names:
            tp = mesh.size(names.index("tp"))
            return Layout(tp=tp, pp=1, dp=world // tp) if tp > 1 and not world % tp else None
    return None


def shape_of(model: Any) -> ModelShape | None:
    """Heads, hidden size and layers from a Hugging Face style ``config`` (wrappers looked through)."""
    inner = getattr(model, "module", model)
    cfg = getattr(inner, "config", None)
    found = [getattr(cfg, k, None) for k in ("num_attention_heads", "hidden_size", "num_hidden_layers")]
    heads, hidden, layers = (v if type(v) is int and v >= 1 else 0 for v in found)
    return ModelShape(heads=heads, hidden=hidden, layers=layers) if heads and hidden and layers else None


class RankRNG:
    """This rank's generators (Python, NumPy, torch CPU, its CUDA device) as JSON-able values.

    A sharded checkpoint keeps per-rank state in JSON, so the torch states travel as bytes.
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": bytes(torch.get_rng_state().numpy()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = bytes(torch.cuda.get_rng_state().numpy())  # the current device: this rank's
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))
