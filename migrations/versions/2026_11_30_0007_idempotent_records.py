"""What makes a retried task's record the same record: an origin key on incidents and rollouts.

A task retried after its transaction committed must find its row, not add a second
one (a second incident would start a second recovery). ``origin`` names what the row
records (``launch:<id>`` for an abnormal end, ``flow-run:<id>:<kind>`` for a serving
change) and is unique. ``announced_at`` says the incident's event went out;
``recovered_by`` is the one recovery flow run that may act on it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 11:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("incident") as b:
        b.add_column(sa.Column("origin", sa.String(200), nullable=True))
        b.add_column(sa.Column("announced_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("recovered_by", sa.String(200), nullable=True))
        b.create_unique_constraint("uq_incident_origin", ["origin"])
    with op.batch_alter_table("rollout") as b:
        b.add_column(sa.Column("origin", sa.String(200), nullable=True))
        b.create_unique_constraint("uq_rollout_origin", ["origin"])


def downgrade() -> None:
    with op.batch_alter_table("rollout") as b:
        b.drop_constraint("uq_rollout_origin", type_="unique")
        b.drop_column("origin")
    with op.batch_alter_table("incident") as b:
        b.drop_constraint("uq_incident_origin", type_="unique")
        b.drop_column("recovered_by")
        b.drop_column("announced_at")
        b.drop_column("origin")
