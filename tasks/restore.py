"""Phase 6, restore: the newest good checkpoint (or a chosen one), from the nearest good copy, made the run's head."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from infra import config
from infra.catalog import lineage
from infra.errors import CorruptCheckpoint
from infra.format import payload
from infra.format.verify import verify_files
from infra.restore import execute, plan
from infra.restore.execute import Skip
from tasks import progress
from tasks.common import RETRY, artifact_key, catalog, emit
from tasks.verify import announce_corrupt


def _announce(run: str, skipped: tuple[Skip, ...]) -> None:
    for s in skipped:
        if s.outcome in ("corrupt", "missing", "unloadable"):
            findings = [f.as_dict() for f in s.findings] or [
                {"problem": s.outcome, "path": "", "detail": s.reason}
            ]
            announce_corrupt(run, s.step, s.checkpoint_id, "", findings)


def _artifact(run: str, result: dict[str, Any], skipped: tuple[Skip, ...], retired: list[int]) -> None:
    how = "downloaded from the " + result["source"] + " tier" if result["fetched"] else "the local copy"
    lines = [
        f"# Restore of `{run}`",
        "",
        f"Restore point: **step {result['step']}** ({how}, `{result['path']}`)",
        "",
    ]
    lines += [f"- skipped {s}" for s in skipped] or ["- no checkpoint skipped"]
    if retired:
        lines.append(f"- retired {len(retired)} newer checkpoint(s) (rolled back)")
    create_markdown_artifact(key=artifact_key("rewind", run, "restore"), markdown="\n".join(lines))


@task(name="restore-checkpoint", timeout_seconds=3600, **RETRY)
def restore_checkpoint(
    run: str,
    step: int | None = None,
    roll_back: bool = False,
    reason: str = "",
    before_step: int | None = None,
) -> dict[str, Any]:
    """Make a verified local copy of the restore point (fetched from a replica if need be), every byte checked.

    ``roll_back`` also retires newer checkpoints so the next launch resumes from the
    chosen one. A chosen step that is corrupt fails at once (not retried); one that
    could not be checked right now (an I/O error) is retried.
    """
    cat = catalog()
    p = plan.plan(cat, run, root=config.checkpoint_root(), step=step, before_step=before_step)
    try:
        with progress.shown(), execute.restoring(cat, p, verify_files) as done:
            retired: list[int] = []
            if roll_back:
                why = reason or f"rolled back to step {done.step}"
                retired = lineage.supersede_after(cat, lineage.get_run(cat, run).id, done.step, why)
            position = payload.data_position(done.directory, done.manifest)
    except CorruptCheckpoint as exc:  # the step the user chose is damaged on every copy
        announce_corrupt(run, step or -1, -1, exc.location, [f.as_dict() for f in exc.findings])
        raise
    _announce(run, done.skipped)
    result = {
        "run": run,
        "step": done.step,
        "checkpoint_id": done.checkpoint_id,
        "path": str(done.directory),
        "source": done.source,
        "fetched": done.fetched,
        "seconds": round(done.seconds, 3),
        "skipped": [{"step": s.step, "outcome": s.outcome, "why": s.reason} for s in done.skipped],
        "retired_checkpoint_ids": retired,
        "data": position,
    }
    get_run_logger().info(
        "restore point of %s: step %d from the %s copy (%s), verified in %.2fs; skipped %d",
        run, done.step, done.source, "downloaded" if done.fetched else "in place", done.seconds, len(done.skipped),
    )  # fmt: skip
    _artifact(run, result, done.skipped, retired)
    emit("rewind.restore.completed", run, result, step=done.step, checkpoint_id=done.checkpoint_id)
    return result
