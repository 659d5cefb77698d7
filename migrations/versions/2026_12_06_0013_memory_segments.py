"""A memory copy's segment digests: the xxh3 of each 32 MiB of each file, recorded when the copy was made.

A restore from the memory tier hashes a file's segments in parallel against these instead of the whole
file on one core (``rewind.infra.format.segments``). NULL for every other copy, and for memory copies
made before this revision: their files are hashed whole, as before.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06 17:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("replica", sa.Column("segments", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replica") as batch:
        batch.drop_column("segments")
