"""A save in flight at a step no longer counts as the step's live checkpoint.

Before, a step saved again superseded the step's committed checkpoint when the new save began, because
the one-live-checkpoint-per-step index counted ``writing``: a save that then failed (a full disk, a crash)
had taken the committed one away. The index now counts ``committed`` and ``verified`` only; the old
checkpoint is superseded in the new one's commit transaction.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06 17:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NOW = "status IN ('committed', 'verified')"
_BEFORE = "status IN ('writing', 'committed', 'verified')"


def _index(where: str) -> None:
    with op.batch_alter_table("checkpoint") as batch:
        batch.drop_index("uq_checkpoint_live_step")
        batch.create_index(
            "uq_checkpoint_live_step",
            ["run_id", "step"],
            unique=True,
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def upgrade() -> None:
    _index(_NOW)


def downgrade() -> None:
    # two saves in flight at one step (one of them orphaned) would break the older index: the older aborted
    op.execute(
        "UPDATE checkpoint SET status = 'aborted', status_reason = 'aborted by a catalog downgrade' "
        "WHERE status = 'writing' AND EXISTS (SELECT 1 FROM checkpoint c2 WHERE c2.run_id = checkpoint.run_id "
        "AND c2.step = checkpoint.step AND c2.id <> checkpoint.id "
        "AND c2.status IN ('writing', 'committed', 'verified') AND (c2.status <> 'writing' OR c2.id > checkpoint.id))"
    )
    _index(_BEFORE)
