"""Job specs, launches and per-rank progress: protecting any job, not one example's shape.

The supervisor launches a run from its spec (command, working directory,
environment, nodes, processes per node, rendezvous), records each launch with
what the job was handed (world size, global batch, learning-rate scale, data
window to skip), and every rank reports its progress into ``rank_progress``
itself: the catalog is the one place every node and the supervisor already reach.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 08:45:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_spec",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_job_spec_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_job_spec")),
    )
    op.create_table(
        "launch",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("handoff", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incident.id"], name=op.f("fk_launch_incident_id_incident"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_launch_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_launch")),
    )
    op.create_index(op.f("ix_launch_run_id"), "launch", ["run_id"], unique=False)
    op.create_table(
        "rank_progress",
        sa.Column("launch_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("samples", sa.BigInteger(), nullable=True),
        sa.Column("step_at", sa.Float(), nullable=True),
        sa.Column("beat_at", sa.Float(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["launch_id"], ["launch.id"], name=op.f("fk_rank_progress_launch_id_launch"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("launch_id", "rank", name=op.f("pk_rank_progress")),
    )


def downgrade() -> None:
    op.drop_table("rank_progress")
    op.drop_index(op.f("ix_launch_run_id"), table_name="launch")
    op.drop_table("launch")
    op.drop_table("job_spec")
