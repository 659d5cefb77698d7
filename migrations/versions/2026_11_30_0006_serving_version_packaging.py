"""The handler a serving version was packed with, so the model's next version can reuse it.

A model's first deploy names its TorchServe handler (and the files it imports); later
rollouts that name none take the stable version's, instead of a default that only
fits the example model.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30 10:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("serving_version", sa.Column("handler", sa.Text(), nullable=True))
    op.add_column("serving_version", sa.Column("extra_files", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("serving_version", "extra_files")
    op.drop_column("serving_version", "handler")
