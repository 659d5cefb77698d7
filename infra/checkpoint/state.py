"""Stateful adapters: how each part of a training job is captured and put back.

Anything with ``state_dict()``/``load_state_dict()`` (modules, optimizers,
schedulers, ``GradScaler``) is used as is; RNG and user extras get small
adapters here. Nothing is captured by pickling trainer objects.
"""

from __future__ import annotations

import functools
import os
import platform
import random
import socket
import sys
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from rewind.infra import redact
from rewind.infra.errors import ConfigError


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class RNGState:
    """Python, NumPy, torch CPU and every CUDA device's generator."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # never starts CUDA in a CPU job
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every generator set, or none: a state refused (another count of CUDA devices) changes nothing."""
        cuda = state.get("cuda") if torch.cuda.is_available() else None
        if cuda is not None and len(cuda) != torch.cuda.device_count():
            raise ConfigError(
                f"checkpoint has RNG state for {len(cuda)} CUDA devices, this process sees {torch.cuda.device_count()}"
            )
        # Generator.set_state reads from the start of the storage, ignoring a view's
        # offset, and restored tensors are views of one read buffer: hand it copies.
        given = state["torch"].clone(), None if cuda is None else [c.clone() for c in cuda]
        was = random.getstate(), np.random.get_state(), torch.get_rng_state()
        # the CUDA generators as they are, where CUDA has started (asking would start it; setting waits for it)
        was_cuda = (
            torch.cuda.get_rng_state_all() if cuda is not None and torch.cuda.is_initialized() else None
        )
        try:
            random.setstate(state["python"])
            np.random.set_state(state["numpy"])
            torch.set_rng_state(given[0])
            if given[1] is not None:
                torch.cuda.set_rng_state_all(given[1])
        except BaseException:
            random.setstate(was[0])
            np.random.set_state(was[1])
            torch.set_rng_state(was[2])
            if was_cuda is not None:
                torch.cuda.set_rng_state_all(was_cuda)
            raise


class DictState:
    """User extras kept in a plain dict, restored in place so references stay valid."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return dict(self.data)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.clear()
        self.data.update(state)


def as_stateful(name: str, obj: object) -> Stateful:
    if isinstance(obj, Stateful):
        return obj
    if isinstance(obj, dict):
        return DictState(obj)
    raise ConfigError(
        f"state {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict() and is not a dict"
    )


def writer(engine: str) -> dict[str, str]:
    """Who wrote a checkpoint, for its manifest: lets a catalog rebuilt from storage say so."""
    return {
        "engine": engine,
        "rewind": _rewind_version(),
        "host": socket.gethostname(),
        "pid": str(os.getpid()),
    }


@functools.cache
def _rewind_version() -> str:
    """Looked up once: reading package metadata costs milliseconds, and a sync save's stall counts them."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rewind")
    except PackageNotFoundError:
        return "unknown"


def environment() -> dict[str, str]:
    """What a restore on another machine should know about the writer."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "pid": str(os.getpid()),
        "argv": " ".join(redact.argv(sys.argv))[:500],
    }
    if torch.version.cuda:
        env["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        env["cudnn"] = str(torch.backends.cudnn.version())
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["gpus"] = str(torch.cuda.device_count())
    return env
