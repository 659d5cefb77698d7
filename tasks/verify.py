"""Phase 2, verify: prove each copy of a checkpoint holds the bytes its catalog recorded."""

from __future__ import annotations

import time
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from rewind.infra.catalog import lineage, overview, overview_text
from rewind.infra.format.verify import Budget
from rewind.infra.phases import verify as phase
from rewind.tasks import progress
from rewind.tasks.common import RETRY, artifact_key, catalog, notifier


# No timeout_seconds: this task also runs inside supervise-training, in a worker thread, where Prefect
# cannot enforce one (it warns instead); a scrub's duration is bounded by the bytes it reads.
@task(name="verify-checkpoint", **RETRY)
def verify_checkpoint(
    checkpoint_id: int, deep: bool = True, tier: str | None = None, deadline: float | None = None
) -> dict[str, Any]:
    """Check every copy of one checkpoint and record each verdict (``phases.verify``).

    A checkpoint with no copy left that verifies is announced and raised (never
    retried); a damaged copy of a checkpoint that another copy still holds is
    announced as a copy event; a copy that could not be read raises a transient
    error, so the task is retried. ``deadline`` (seconds since the epoch) bounds every attempt
    together: copies not reached before it are ``unchecked`` in the result (nothing known, nothing
    raised, nothing retried).
    """
    with progress.shown():
        result = phase.verify_checkpoint(
            catalog(),
            checkpoint_id=checkpoint_id,
            notify=notifier(),
            deep=deep,
            tiers=None if tier is None else (tier,),
            budget=None if deadline is None else Budget(seconds=max(0.0, deadline - time.time())),
        )
    result.raise_for_verdict()
    return result.as_dict()


@task(name="list-checkpoints", **RETRY)
def list_checkpoints(run: str | None = None) -> list[dict[str, Any]]:
    """Checkpoints worth checking (committed, verified, or corrupt with a copy left) of one run, or all."""
    return [
        {"run": name, "step": step, "checkpoint_id": ck_id}
        for name, step, ck_id in phase.worth_checking(catalog(), run=run)
    ]


@task(name="checkpoint-table", **RETRY)
def checkpoint_table(run: str) -> int:
    """A table a person reads in the UI: every checkpoint of the run with status, size, digest and parent."""
    cat = catalog()
    rows = lineage.checkpoints(cat, run)
    steps = {c.id: c.step for c in rows}
    table = [
        {
            "step": c.step,
            "status": c.status,
            "bytes": c.total_bytes,
            "manifest_digest": c.manifest_digest,
            "parent_step": steps.get(c.parent_id) if c.parent_id else None,
            "loss": (c.metrics or {}).get("loss"),
            "reason": c.status_reason or "",
        }
        for c in rows
    ]
    create_table_artifact(
        key=artifact_key("rewind", run, "checkpoints"), table=table, description=f"Checkpoints of {run}"
    )
    return len(table)


@task(name="check-catalog", **RETRY)
def check_catalog(run: str | None = None, deep: bool = False, rows: bool = True) -> list[dict[str, Any]]:
    """The catalog against storage, both ways (rows without files, files without rows, bytes that differ).

    Changes nothing; publishes the findings as an artifact. ``rows=False``: only copies on
    the tiers that no row names (after a scrub, which has just checked every row's copy).
    """
    from rewind.infra.inventory.drift import check

    found = [f.as_dict() for f in check(catalog(), run=run, deep=deep, rows=rows)]
    create_table_artifact(
        key=artifact_key("rewind", run or "all", "catalog-check"),
        table=found or [{"kind": "none", "detail": "catalog and storage agree"}],
        description="Catalog against storage",
    )
    return found


@task(name="status-overview", **RETRY)
def status_overview(run: str | None = None) -> str:
    """`rewind status` as a markdown artifact: is each run protected right now, refreshed by every scrub."""
    text = overview_text.text(overview.status(catalog(), run))
    create_markdown_artifact(
        key=artifact_key("rewind", run or "all", "status"),
        markdown="\n".join("    " + line for line in text.splitlines()),  # a code block no reason can end
        description="rewind status: newest verified step, what dying now would cost, copies, incidents, models",
    )
    return text
