"""Rewind: workflow-orchestrated rollback for AI training and model serving.

Everything Rewind installs lives under this package: ``rewind.infra`` (engines, no Prefect),
``rewind.tasks`` (Prefect tasks over the phases), ``rewind.flows`` (flows and the ``rewind`` CLI),
``rewind.migrations`` (the catalog's Alembic scripts) and ``rewind.examples`` (the example jobs).

The training-side API is re-exported here, loaded on first use so that ``import rewind.flows.cli``
does not pay for torch::

    from rewind import TrainingSession, Checkpointer, ShardedCheckpointer, ResumableLoader
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.checkpoint.sharded import ShardedCheckpointer
    from rewind.infra.training.data import ResumableLoader
    from rewind.infra.training.session import TrainingSession

__all__ = ["Checkpointer", "ResumableLoader", "ShardedCheckpointer", "TrainingSession"]

_EXPORTS = {
    "Checkpointer": "rewind.infra.checkpoint.engine",
    "ShardedCheckpointer": "rewind.infra.checkpoint.sharded",
    "ResumableLoader": "rewind.infra.training.data",
    "TrainingSession": "rewind.infra.training.session",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rewind' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
