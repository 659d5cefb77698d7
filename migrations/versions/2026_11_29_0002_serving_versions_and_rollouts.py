"""Serving versions and rollouts: every version in production traceable to its checkpoint.

Run, step and manifest digest are copied onto the version row so the lineage
outlives the checkpoint; a partial unique index allows one stable version per model.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 18:26:44.269167
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rollout",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=63), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("from_version", sa.String(length=63), nullable=True),
        sa.Column("to_version", sa.String(length=63), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("triggered_by", sa.Text(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("switch_s", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout")),
    )
    op.create_index(op.f("ix_rollout_model"), "rollout", ["model"], unique=False)
    op.create_table(
        "rollout_step",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("weights", sa.JSON(), nullable=True),
        sa.Column("gates", sa.JSON(), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["rollout_id"],
            ["rollout.id"],
            name=op.f("fk_rollout_step_rollout_id_rollout"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_step")),
    )
    op.create_index(op.f("ix_rollout_step_rollout_id"), "rollout_step", ["rollout_id"], unique=False)
    op.create_table(
        "serving_version",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=63), nullable=False),
        sa.Column("version", sa.String(length=63), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("run", sa.String(length=200), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("manifest_digest", sa.String(length=64), nullable=False),
        sa.Column("artifact_uri", sa.Text(), nullable=False),
        sa.Column("artifact_digest", sa.String(length=64), nullable=False),
        sa.Column("artifact_bytes", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("weight", sa.Integer(), nullable=False),
        sa.Column("was_stable", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("unloaded_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoint.id"],
            name=op.f("fk_serving_version_checkpoint_id_checkpoint"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_serving_version")),
        sa.UniqueConstraint("model", "version", name=op.f("uq_serving_version_model")),
    )
    op.create_index(
        op.f("ix_serving_version_checkpoint_id"), "serving_version", ["checkpoint_id"], unique=False
    )
    op.create_index(
        "uq_serving_version_stable",
        "serving_version",
        ["model"],
        unique=True,
        postgresql_where=sa.text("state = 'stable'"),
        sqlite_where=sa.text("state = 'stable'"),
    )


def downgrade() -> None:
    op.drop_index(
        "uq_serving_version_stable",
        table_name="serving_version",
        postgresql_where=sa.text("state = 'stable'"),
        sqlite_where=sa.text("state = 'stable'"),
    )
    op.drop_index(op.f("ix_serving_version_checkpoint_id"), table_name="serving_version")
    op.drop_table("serving_version")
    op.drop_index(op.f("ix_rollout_step_rollout_id"), table_name="rollout_step")
    op.drop_table("rollout_step")
    op.drop_index(op.f("ix_rollout_model"), table_name="rollout")
    op.drop_table("rollout")
