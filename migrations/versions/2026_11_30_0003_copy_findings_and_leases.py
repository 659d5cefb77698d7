"""Findings per copy, restore leases, and status columns the database itself enforces.

A check's verdict belongs to the copy it read, so replicas gain the key of the
copy below the tier's URI, the detail of the last check and when it ran; an
unreadable copy becomes ``unverifiable`` instead of condemning the checkpoint.
A restore in progress takes a lease on its checkpoint so retention cannot delete
it underneath, and a checkpoint records when it last changed, so the grace period
before dead copies are reclaimed counts from its death, not its birth. Status and state columns get named CHECK constraints so a typo
anywhere fails at the database instead of leaving a row no code understands;
values that predate the constraints are mapped first (``restoring`` was a
replica status and is now ``pending``; anything else unknown becomes the
conservative choice of each column).

On SQLite the CHECK constraints are written into the stored table definition
(SQLite's documented ``writable_schema`` procedure) instead of a batch "move and
copy": the catalog runs with ``PRAGMA foreign_keys=ON`` and migrates inside one
transaction where that pragma cannot be turned off, and dropping the old
``checkpoint`` or ``rollout`` table would fire ON DELETE CASCADE / SET NULL and
empty ``replica``, ``checkpoint_file``, ``rollout_step`` and every lineage link.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 10:12:31.118204
"""

import re
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The values as of this revision (frozen here: the models' enums may grow later).
CHECKPOINT_STATUSES = ("writing", "committed", "verified", "corrupt", "aborted", "superseded", "deleted")
REPLICA_STATUSES = ("pending", "verified", "unverifiable", "corrupt", "missing", "deleted")
VERSION_STATES = ("exported", "loaded", "canary", "stable", "previous", "retired", "rolled_back", "failed")
ROLLOUT_STATES = ("running", "promoted", "rolled_back", "failed", "done")

# (table, column, allowed values, what an unknown value becomes on upgrade)
ENUMS = (
    ("checkpoint", "status", CHECKPOINT_STATUSES, "corrupt"),
    ("replica", "status", REPLICA_STATUSES, "unverifiable"),
    ("serving_version", "state", VERSION_STATES, "failed"),
    ("rollout", "state", ROLLOUT_STATES, "failed"),
)
NEW_REPLICA_STATUSES = ("unverifiable", "missing")  # not in 0002: downgraded to "corrupt"


def _check_sql(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _set_status(table: str, column: str, to: str, where: sa.ColumnElement[bool]) -> None:
    op.execute(sa.table(table, sa.column(column)).update().where(where).values({column: to}))


def _sqlite_rewrite_table(table: str, edit: Callable[[str], str]) -> None:
    """Replace ``table``'s stored CREATE TABLE text with ``edit(text)``, in the current transaction."""
    bind = op.get_bind()
    sql = bind.execute(
        sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :t"), {"t": table}
    ).scalar_one()
    version = bind.exec_driver_sql("PRAGMA schema_version").scalar_one()
    bind.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        bind.execute(
            sa.text("UPDATE sqlite_master SET sql = :sql WHERE type = 'table' AND name = :t"),
            {"sql": edit(sql), "t": table},
        )
        bind.exec_driver_sql(f"PRAGMA schema_version = {int(version) + 1}")  # every connection reloads
    finally:
        bind.exec_driver_sql("PRAGMA writable_schema = OFF")
    bind.execute(sa.text(f"SELECT 1 FROM {table} LIMIT 1")).all()  # the new definition parses


def _create_check(table: str, name: str, condition: str) -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.create_check_constraint(name, table, condition)
        return

    def add(sql: str) -> str:
        body = sql.rstrip()
        if not body.endswith(")"):
            raise RuntimeError(f"unexpected definition of table {table}: {sql!r}")
        return f"{body[:-1].rstrip()}, \n\tCONSTRAINT {name} CHECK ({condition})\n)"

    _sqlite_rewrite_table(table, add)


def _drop_check(table: str, name: str) -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(name, table, type_="check")
        return
    pattern = re.compile(rf',\s*CONSTRAINT\s+"?{re.escape(name)}"?\s+CHECK\s*\((?:[^()]|\([^()]*\))*\)')

    def remove(sql: str) -> str:
        new, found = pattern.subn("", sql)
        if found != 1:
            raise RuntimeError(f"table {table} has {found} constraints named {name}, expected 1")
        return new

    _sqlite_rewrite_table(table, remove)


def upgrade() -> None:
    # Data first: on SQLite the driver opens the transaction at the first UPDATE, and DDL
    # before it would be committed on the spot, surviving a failure later in this migration.
    _set_status("replica", "status", "pending", sa.column("status") == "restoring")
    for table, column, values, fallback in ENUMS:
        _set_status(table, column, fallback, sa.column(column).not_in(values))

    op.create_table(
        "restore_lease",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoint.id"],
            name=op.f("fk_restore_lease_checkpoint_id_checkpoint"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_restore_lease")),
    )
    op.create_index(op.f("ix_restore_lease_checkpoint_id"), "restore_lease", ["checkpoint_id"], unique=False)

    # Plain ADD COLUMN on both backends: batch mode does not copy the table for this.
    with op.batch_alter_table("replica", schema=None) as batch_op:
        batch_op.add_column(sa.Column("key", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("detail", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("checked_at", sa.DateTime(timezone=True), nullable=True))

    # When a checkpoint last changed: retention's grace period for dead copies counts from it.
    op.add_column("checkpoint", sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))

    for table, column, values, _ in ENUMS:
        _create_check(table, op.f(f"ck_{table}_{column}"), _check_sql(column, values))


def downgrade() -> None:
    _set_status("replica", "status", "corrupt", sa.column("status").in_(NEW_REPLICA_STATUSES))  # data first
    for table, column, _, _ in reversed(ENUMS):
        _drop_check(table, op.f(f"ck_{table}_{column}"))

    # Copies the replica table on SQLite: safe, no foreign key points at replica.
    with op.batch_alter_table("replica", schema=None) as batch_op:
        batch_op.drop_column("checked_at")
        batch_op.drop_column("detail")
        batch_op.drop_column("key")

    # A plain DROP COLUMN (SQLite 3.35+): a batch copy of checkpoint would fire its foreign keys.
    op.drop_column("checkpoint", "updated_at")
    op.drop_index(op.f("ix_restore_lease_checkpoint_id"), table_name="restore_lease")
    op.drop_table("restore_lease")
