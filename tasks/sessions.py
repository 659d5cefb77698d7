"""Conversations' history in the catalog: expire what is past its TTL (the serving side writes it)."""

from __future__ import annotations

from prefect import get_run_logger, task

from rewind.infra.catalog import sessions
from rewind.tasks.common import RETRY, catalog


@task(name="expire-conversations", **RETRY)
def expire_conversations() -> int:
    """Delete conversations past their TTL, with their turns and block names; idempotent."""
    gone = sessions.expire(catalog())
    if gone:
        get_run_logger().info("expired %d conversation(s) past their TTL", gone)
    return gone
