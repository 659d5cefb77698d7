"""Phase 2, verify: prove each copy of a checkpoint holds the bytes its catalog recorded."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.catalog import copies, lineage, overview, overview_text
from infra.catalog.models import CheckpointStatus
from infra.errors import CheckpointUnverifiable, CorruptCheckpoint
from infra.format.verify import Verdict
from infra.restore.scrub import scrub
from tasks import progress
from tasks.common import RETRY, artifact_key, catalog, emit


# No timeout_seconds: this task also runs inside supervise-training, in a worker thread, where Prefect
# cannot enforce one (it warns instead); a scrub's duration is bounded by the bytes it reads.
@task(name="verify-checkpoint", **RETRY)
def verify_checkpoint(checkpoint_id: int, deep: bool = True, tier: str | None = None) -> dict[str, Any]:
    """Check every copy of one checkpoint and record each verdict.

    A checkpoint with no copy left that verifies is announced and raised (never
    retried); a damaged copy of a checkpoint that another copy still holds is
    announced as a copy event; a copy that could not be read raises a transient
    error, so the task is retried.
    """
    cat = catalog()
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    run = lineage.get_run_by_id(cat, ck.run_id).name
    with progress.shown():
        check = scrub(cat, ck, deep=deep, tiers=None if tier is None else (tier,))
    result = {
        "run": run,
        "step": ck.step,
        "checkpoint_id": ck.id,
        "ok": check.ok,
        "status": check.status,
        "deep": deep,
        "manifest_digest": ck.manifest_digest,
        "copies": [{"tier": c.tier, "where": c.where, "verdict": c.verdict.value} for c in check.copies],
        "findings": [f.as_dict() for f in check.findings],
    }
    get_run_logger().info(
        "%s step %d (%s check): checkpoint %s; %s",
        run,
        ck.step,
        "deep" if deep else "quick",
        check.status,
        ", ".join(f"{c.tier} {c.verdict.value}" for c in check.copies) or "no copy",
    )
    for c in check.copies:
        if c.verdict in (Verdict.CORRUPT, Verdict.MISSING):
            payload = {"tier": c.tier, "where": c.where, "findings": [f.as_dict() for f in c.findings]}
            emit("rewind.copy.corrupt", run, payload, step=ck.step, checkpoint_id=ck.id)
    if check.status == CheckpointStatus.CORRUPT:
        announce_corrupt(run, ck.step, ck.id, ck.path, [f.as_dict() for f in check.findings])
        raise CorruptCheckpoint(f"{run} step {ck.step}", [f for f in check.findings if f.fatal])
    unreadable = [c for c in check.copies if c.verdict is Verdict.UNVERIFIABLE]
    if unreadable:
        raise CheckpointUnverifiable(
            f"{run} step {ck.step}: "
            + "; ".join(f"{c.tier} copy unverifiable: {c.findings[0]}" for c in unreadable)
        )
    if deep and check.status == CheckpointStatus.VERIFIED:
        emit("rewind.checkpoint.verified", run, result, step=ck.step, checkpoint_id=ck.id)
    return result


def announce_corrupt(
    run: str, step: int, checkpoint_id: int, path: str, findings: list[dict[str, str]]
) -> None:
    """The artifact and ``rewind.checkpoint.corrupt`` event for a checkpoint that failed verification."""
    create_table_artifact(
        key=artifact_key("rewind", run, "corrupt", step),
        table=findings,
        description=f"Checkpoint {run} step {step} failed verification: {path}",
    )
    payload = {"step": step, "checkpoint_id": checkpoint_id, "path": path, "findings": findings}
    emit("rewind.checkpoint.corrupt", run, payload, step=step, checkpoint_id=checkpoint_id)


@task(name="list-checkpoints", **RETRY)
def list_checkpoints(run: str | None = None) -> list[dict[str, Any]]:
    """Checkpoints worth checking (committed, verified, or corrupt with a copy left) of one run, or all."""
    cat = catalog()
    runs = [run] if run else [r["run"] for r in lineage.list_runs(cat)]
    return [
        {"run": name, "step": step, "checkpoint_id": ck_id}
        for name in runs
        for ck_id, step in copies.worth_checking(cat, lineage.get_run(cat, name).id)
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
    from infra.inventory.drift import check

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
