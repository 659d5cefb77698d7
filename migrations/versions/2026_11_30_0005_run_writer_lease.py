"""One writer per run: the process that holds a run's checkpoints, and when it was last seen.

Two processes training the same run used to collide at their first save; now the
second is refused at start, with the holder named. A holder that died (its pid gone
on the same host, its launch ended, or silent past the lease's time) is taken over.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 10:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("run", sa.Column("writer", sa.Text(), nullable=True))
    op.add_column("run", sa.Column("writer_seen_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+): a batch copy of `run` would fire the foreign keys that point at it.
    op.drop_column("run", "writer_seen_at")
    op.drop_column("run", "writer")
