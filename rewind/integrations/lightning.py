"""``RewindCallback`` for PyTorch Lightning (the code: ``rewind.infra.integrations.lightning``)."""

from rewind.infra.integrations.lightning import RewindCallback, RewindCheckpointIO

__all__ = ["RewindCallback", "RewindCheckpointIO"]
