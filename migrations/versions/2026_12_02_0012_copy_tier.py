"""The disk of a local copy: a node-local checkpoint directory is judged only where that disk is seen.

``replica.tier_id`` is the id in the ``.rewind-tier`` mark at the root of the local tier holding the copy,
``replica.host`` the host that made the mark (for people). Shared and off-site copies keep NULL (reachable
from anywhere), and so do local copies registered before this revision (their disk is not known: they are
judged wherever they are looked at, as before).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 06:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("replica", sa.Column("tier_id", sa.String(64), nullable=True))
    op.add_column("replica", sa.Column("host", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replica") as batch:
        batch.drop_column("host")
        batch.drop_column("tier_id")
