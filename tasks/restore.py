"""Phase 6, restore: choose the newest good checkpoint (or a chosen one) and make it the run's head."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from infra.checkpoint import recovery
from infra.errors import CorruptCheckpoint
from tasks.common import RETRY, artifact_key, catalog, emit
from tasks.verify import announce_corrupt


@task(name="plan-restore", **RETRY)
def plan_restore(run: str, step: int | None = None) -> dict[str, Any]:
    """List the candidates, newest first, without touching any file."""
    p = recovery.plan(catalog(), run, step)
    return {"run": run, "step": step, "candidates": [asdict(c) for c in p.candidates]}


@task(name="restore-checkpoint", timeout_seconds=3600, **RETRY)
def restore_checkpoint(
    run: str,
    step: int | None = None,
    roll_back: bool = False,
    reason: str = "",
    before_step: int | None = None,
) -> dict[str, Any]:
    """Deep-verify candidates in plan order and pick the first good one.

    ``roll_back`` also retires newer checkpoints so the next launch resumes from
    the chosen one. A chosen step that is corrupt fails at once (not retried).
    """
    cat = catalog()
    plan = recovery.plan(cat, run, step, before_step=before_step)
    try:
        chosen = recovery.execute(cat, plan)
    except CorruptCheckpoint as exc:  # the step the user chose is damaged
        c = plan.candidates[0]
        announce_corrupt(run, c.step, c.checkpoint_id, c.path, [f.as_dict() for f in exc.findings])
        raise
    by_step = {c.step: c for c in plan.candidates}
    for s, why in chosen.skipped:
        c = by_step[s]
        announce_corrupt(
            run, s, c.checkpoint_id, c.path, [{"problem": "corrupt", "path": c.path, "detail": why}]
        )
    retired: list[int] = []
    if roll_back:
        retired = recovery.roll_back_to(cat, run, chosen, reason or f"rolled back to step {chosen.step}")
    result = {
        "run": run,
        "step": chosen.step,
        "checkpoint_id": chosen.checkpoint_id,
        "path": chosen.path,
        "skipped": [{"step": s, "why": w} for s, w in chosen.skipped],
        "retired_checkpoint_ids": retired,
        "data": recovery.data_position(Path(chosen.path)),
    }
    lines = [f"# Restore of `{run}`", "", f"Restore point: **step {chosen.step}** (`{chosen.path}`)", ""]
    lines += [f"- skipped step {s}: {w}" for s, w in chosen.skipped] or ["- no checkpoint skipped"]
    if retired:
        lines.append(f"- retired {len(retired)} newer checkpoint(s) (rolled back)")
    create_markdown_artifact(key=artifact_key("rewind", run, "restore"), markdown="\n".join(lines))
    emit("rewind.restore.completed", run, result, step=chosen.step, checkpoint_id=chosen.checkpoint_id)
    return result
