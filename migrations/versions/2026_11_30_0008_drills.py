"""Recovery drills: one row per Chaos Toolkit experiment run against a job.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 12:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "drill",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("scenario", sa.String(100), nullable=False),
        sa.Column("failure_kind", sa.String(32), nullable=False),
        sa.Column("run_name", sa.String(200), nullable=True),
        sa.Column("incident_id", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("phases", sa.JSON(), nullable=False),
        sa.Column("rto_s", sa.Float(), nullable=True),
        sa.Column("rpo_steps", sa.Integer(), nullable=True),
        sa.Column("rpo_s", sa.Float(), nullable=True),
        sa.Column("loss_max_deviation", sa.Float(), nullable=True),
        sa.Column("loss_curve", sa.JSON(), nullable=True),
        sa.Column("failed_phase", sa.String(32), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("seed", sa.Integer(), nullable=True),
        sa.Column("slo", sa.JSON(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incident.id"], name="fk_drill_incident_id_incident", ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_drill"),
    )
    op.create_index("ix_drill_scenario", "drill", ["scenario"])


def downgrade() -> None:
    op.drop_index("ix_drill_scenario", table_name="drill")
    op.drop_table("drill")
