"""Conversations outside the serving process: sessions (with a TTL) and their turns.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30 15:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "chat_session",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_key", sa.String(200), nullable=False),
        sa.Column("model", sa.String(100), nullable=False),
        sa.Column("tokens", sa.JSON(), nullable=False),
        sa.Column("blocks", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_turn_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_chat_session"),
        sa.UniqueConstraint("session_key", name="uq_chat_session_session_key"),
    )
    op.create_index("ix_chat_session_expires_at", "chat_session", ["expires_at"])
    op.create_table(
        "chat_turn",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.JSON(), nullable=False),
        sa.Column("reply", sa.JSON(), nullable=False),
        sa.Column("instance", sa.String(200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chat_session.id"],
            name="fk_chat_turn_session_id_chat_session",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_chat_turn"),
        sa.UniqueConstraint("session_id", "n", name="uq_chat_turn_session_id"),
    )
    op.create_index("ix_chat_turn_session_id", "chat_turn", ["session_id"])


def downgrade() -> None:
    op.drop_index("ix_chat_turn_session_id", table_name="chat_turn")
    op.drop_table("chat_turn")
    op.drop_index("ix_chat_session_expires_at", table_name="chat_session")
    op.drop_table("chat_session")
