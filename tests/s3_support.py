"""A real S3 server on loopback for the tests: SeaweedFS (`weed mini`), started by ``infra.drills.servers``
(the drills start the same one)."""

from __future__ import annotations

from infra.drills.servers import ACCESS_KEY, SECRET_KEY, SeaweedS3, weed_binary

BUCKET = "rewind"  # created by the ``s3`` fixture

__all__ = ["ACCESS_KEY", "BUCKET", "SECRET_KEY", "SeaweedS3", "weed_binary"]
