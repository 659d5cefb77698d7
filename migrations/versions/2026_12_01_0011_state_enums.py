"""Kinds, states and outcomes the database itself enforces, as 0003 did for statuses.

``incident.kind``, ``rank_progress.state``, ``drill.outcome`` and ``rollout.kind`` were plain
strings checked (if at all) by the code that wrote them; the models now declare them as enums,
and each gets a named CHECK constraint so a typo anywhere fails at the database instead of
leaving a row no code understands. Nothing is mapped: every value Rewind ever wrote is allowed,
and a catalog holding any other value is refused (which rows, and what they hold) before any
change, on SQLite too, where adding a CHECK constraint does not look at the rows already there.

On SQLite the constraints are written into the stored table definition, as 0003 does and for
the same reason: a batch "move and copy" of ``incident`` or ``rollout`` would fire the ON DELETE
SET NULL / CASCADE of ``launch``, ``drill`` and ``rollout_step`` (the catalog migrates with
``PRAGMA foreign_keys=ON``, inside one transaction where it cannot be turned off).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 12:00:00.000000
"""

import re
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The values as of this revision (frozen here: the models' enums may grow later).
INCIDENT_KINDS = ("crash", "failed_to_start", "hang", "nan", "loss_spike", "gpu", "manual", "finished")
RANK_STATES = ("running", "busy", "finished", "failed", "anomaly")
DRILL_OUTCOMES = ("passed", "failed", "skipped")
ROLLOUT_KINDS = ("deploy", "rollout", "rollback")

# (table, column, allowed values)
ENUMS = (
    ("incident", "kind", INCIDENT_KINDS),
    ("rank_progress", "state", RANK_STATES),
    ("drill", "outcome", DRILL_OUTCOMES),
    ("rollout", "kind", ROLLOUT_KINDS),
)


def _check_sql(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _refuse_unknown(table: str, column: str, values: Sequence[str]) -> None:
    t = sa.table(table, sa.column(column))
    found = op.get_bind().execute(sa.select(t.c[column]).distinct().where(t.c[column].not_in(values))).all()
    if found:
        raise RuntimeError(
            f"{table}.{column} holds {sorted(str(v) for (v,) in found)}, not one of {values}: "
            "correct or delete those rows, then upgrade again"
        )


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
    for table, column, values in ENUMS:  # every check first: a refusal leaves the catalog as it was
        _refuse_unknown(table, column, values)
    for table, column, values in ENUMS:
        _create_check(table, op.f(f"ck_{table}_{column}"), _check_sql(column, values))


def downgrade() -> None:
    for table, column, _ in reversed(ENUMS):
        _drop_check(table, op.f(f"ck_{table}_{column}"))
