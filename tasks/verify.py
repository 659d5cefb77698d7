"""Phase 2, verify: prove a checkpoint's bytes match its manifest."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from infra.catalog import lineage
from infra.checkpoint.audit import verify_recorded
from infra.errors import CorruptCheckpoint
from tasks.common import RETRY, artifact_key, catalog, emit


@task(name="verify-checkpoint", timeout_seconds=3600, **RETRY)
def verify_checkpoint(checkpoint_id: int, deep: bool = True) -> dict[str, Any]:
    """Check one checkpoint; corrupt ones are marked, announced and raised (never retried)."""
    cat = catalog()
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    run = lineage.get_run_by_id(cat, ck.run_id).name
    report = verify_recorded(cat, ck, deep=deep)
    result = {
        "run": run,
        "step": ck.step,
        "checkpoint_id": ck.id,
        "ok": report.ok,
        "deep": deep,
        "manifest_digest": ck.manifest_digest,
        "findings": [f.as_dict() for f in report.findings],
    }
    if report.ok:
        if deep:
            emit("rewind.checkpoint.verified", run, result, step=ck.step, checkpoint_id=ck.id)
        return result
    announce_corrupt(run, ck.step, ck.id, ck.path, result["findings"])
    raise CorruptCheckpoint(ck.path, [f for f in report.findings if f.fatal])


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
    """Committed and verified checkpoints of one run, or of every run."""
    cat = catalog()
    runs = [run] if run else [r["run"] for r in lineage.list_runs(cat)]
    out = []
    for name in runs:
        for ck in lineage.checkpoints(cat, name):
            if ck.status in ("committed", "verified"):
                out.append({"run": name, "step": ck.step, "checkpoint_id": ck.id})
    return out


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
