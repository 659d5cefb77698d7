"""Initial catalog: runs, checkpoints with lineage, files, replicas, incidents.

The partial unique index allows one live checkpoint per (run, step) while keeping
corrupt and aborted attempts at the same step as history.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 15:26:10.407310
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "run",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=True),
        sa.Column("code_version", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run")),
        sa.UniqueConstraint("name", name=op.f("uq_run_name")),
    )
    op.create_table(
        "checkpoint",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("layout", sa.JSON(), nullable=False),
        sa.Column("total_bytes", sa.BigInteger(), nullable=True),
        sa.Column("manifest_digest", sa.String(length=64), nullable=True),
        sa.Column("environment", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("save_stall_s", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("verified_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["checkpoint.id"],
            name=op.f("fk_checkpoint_parent_id_checkpoint"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_checkpoint_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint")),
    )
    with op.batch_alter_table("checkpoint", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoint_run_id"), ["run_id"], unique=False)
        batch_op.create_index(
            "uq_checkpoint_live_step",
            ["run_id", "step"],
            unique=True,
            postgresql_where=sa.text("status IN ('writing', 'committed', 'verified')"),
            sqlite_where=sa.text("status IN ('writing', 'committed', 'verified')"),
        )

    op.create_table(
        "checkpoint_file",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("xxh3", sa.String(length=32), nullable=False),
        sa.Column("crc32c", sa.String(length=12), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoint.id"],
            name=op.f("fk_checkpoint_file_checkpoint_id_checkpoint"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_file")),
    )
    with op.batch_alter_table("checkpoint_file", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoint_file_checkpoint_id"), ["checkpoint_id"], unique=False)

    op.create_table(
        "incident",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("detected_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("decision", sa.Text(), nullable=True),
        sa.Column("restored_checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("layout_before", sa.JSON(), nullable=True),
        sa.Column("layout_after", sa.JSON(), nullable=True),
        sa.Column("detection_s", sa.Float(), nullable=True),
        sa.Column("rebuild_s", sa.Float(), nullable=True),
        sa.Column("load_s", sa.Float(), nullable=True),
        sa.Column("replayed_steps", sa.Integer(), nullable=True),
        sa.Column("rto_s", sa.Float(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["restored_checkpoint_id"],
            ["checkpoint.id"],
            name=op.f("fk_incident_restored_checkpoint_id_checkpoint"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name=op.f("fk_incident_run_id_run"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incident")),
    )
    with op.batch_alter_table("incident", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_incident_run_id"), ["run_id"], unique=False)

    op.create_table(
        "replica",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("verified_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoint.id"],
            name=op.f("fk_replica_checkpoint_id_checkpoint"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replica")),
    )
    with op.batch_alter_table("replica", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_replica_checkpoint_id"), ["checkpoint_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("replica", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_replica_checkpoint_id"))

    op.drop_table("replica")
    with op.batch_alter_table("incident", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_incident_run_id"))

    op.drop_table("incident")
    with op.batch_alter_table("checkpoint_file", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoint_file_checkpoint_id"))

    op.drop_table("checkpoint_file")
    with op.batch_alter_table("checkpoint", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_checkpoint_live_step",
            postgresql_where=sa.text("status IN ('writing', 'committed', 'verified')"),
            sqlite_where=sa.text("status IN ('writing', 'committed', 'verified')"),
        )
        batch_op.drop_index(batch_op.f("ix_checkpoint_run_id"))

    op.drop_table("checkpoint")
    op.drop_table("run")
