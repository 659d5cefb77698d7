"""Indexes for a catalog of 100,000 checkpoints: a run's checkpoints by step, copies by where they lie.

``checkpoint (run_id, step)``: listings, restore plans and retention read a run's checkpoints in step
order, and the newest page of a listing walks this index instead of sorting the whole run.
``replica (tier, uri, key)``: whether a copy's place is still someone else's (retention, before every
deletion), copies following a moved directory, and what a tier still lacks were full scans of every copy.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 09:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_checkpoint_run_id_step", "checkpoint", ["run_id", "step"])
    op.create_index("ix_replica_tier_uri_key", "replica", ["tier", "uri", "key"])


def downgrade() -> None:
    op.drop_index("ix_replica_tier_uri_key", table_name="replica")
    op.drop_index("ix_checkpoint_run_id_step", table_name="checkpoint")
