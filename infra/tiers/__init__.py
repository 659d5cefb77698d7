"""Storage tiers: local disk (the checkpoint root), a shared path, S3-compatible object storage."""

from __future__ import annotations

from rewind.infra.tiers.base import Tier
from rewind.infra.tiers.filesystem import FileTier


def open_tier(uri: str, **s3_options: object) -> Tier:
    """A tier from its URI: ``s3://bucket/prefix`` or an absolute path / ``file://`` URL."""
    if uri.startswith("s3://"):
        from rewind.infra.tiers.s3 import S3Tier

        return S3Tier(uri, **s3_options)  # type: ignore[arg-type]
    return FileTier(uri)
