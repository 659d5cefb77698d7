"""``RewindCallback`` for ``transformers.Trainer`` (the code: ``rewind.infra.integrations.transformers``)."""

from rewind.infra.integrations.transformers import RewindCallback

__all__ = ["RewindCallback"]
