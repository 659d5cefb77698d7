"""Phase 2, verify: prove each copy of a checkpoint holds the bytes its catalog recorded, and say so.

``verify_checkpoint`` checks the copies (``restore.scrub``: quarantine, verdicts, the
checkpoint's status settled), then announces: ``rewind.copy.corrupt`` for each damaged or
missing copy, ``rewind.checkpoint.corrupt`` (with a findings table) when no copy is left
that verifies, ``rewind.checkpoint.verified`` after a deep check that passed. It never
raises for what it found: ``VerifyResult.raise_for_verdict`` does, for callers that fail on it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rewind.infra.catalog import copies, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, CheckpointStatus, aware
from rewind.infra.errors import CheckpointUnverifiable, CorruptCheckpoint, RewindError
from rewind.infra.format.verify import Budget, Finding, Problem, Verdict
from rewind.infra.phases.notify import Notifier, artifact_key, run_event
from rewind.infra.restore.scrub import CheckpointCheck, CopyCheck, scrub

CHECKABLE = (CheckpointStatus.COMMITTED, CheckpointStatus.VERIFIED, CheckpointStatus.CORRUPT)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What one verification found: the checkpoint's status after it, and each copy's verdict."""

    run: str
    manifest_digest: str
    path: str
    check: CheckpointCheck  # the scrub's verdicts, per copy

    @property
    def step(self) -> int:
        return self.check.step

    @property
    def checkpoint_id(self) -> int:
        return self.check.checkpoint_id

    @property
    def deep(self) -> bool:
        return self.check.deep

    @property
    def copies(self) -> tuple[CopyCheck, ...]:
        return self.check.copies

    @property
    def ok(self) -> bool:
        return self.check.ok

    @property
    def findings(self) -> list[Finding]:
        return self.check.findings

    @property
    def status(self) -> CheckpointStatus:
        return CheckpointStatus(self.check.status)

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "ok": self.ok,
            "status": self.status.value,
            "deep": self.deep,
            "manifest_digest": self.manifest_digest,
            "path": self.path,
            "copies": [
                {
                    "tier": c.tier,
                    "where": c.where,
                    "verdict": c.verdict.value,
                    "findings": [f.as_dict() for f in c.findings],
                }
                for c in self.copies
            ],
            "findings": [f.as_dict() for f in self.findings],
            "unchecked": self.check.unchecked,
            "elsewhere": list(self.check.elsewhere),
        }

    def raise_for_verdict(self) -> None:
        """``CorruptCheckpoint`` when no copy verifies (never worth a retry); ``CheckpointUnverifiable``
        (transient) when a copy could not be read right now."""
        if self.status is CheckpointStatus.CORRUPT:
            raise CorruptCheckpoint(f"{self.run} step {self.step}", [f for f in self.findings if f.fatal])
        unreadable = [c for c in self.copies if c.verdict is Verdict.UNVERIFIABLE and not _unchecked(c)]
        if unreadable:
            raise CheckpointUnverifiable(
                f"{self.run} step {self.step}: "
                + "; ".join(f"{c.tier} copy unverifiable: {c.findings[0]}" for c in unreadable)
            )


def verify_checkpoint(
    cat: Catalog,
    *,
    checkpoint_id: int,
    notify: Notifier,
    deep: bool = True,
    tiers: Collection[str] | None = None,
    budget: Budget | None = None,
) -> VerifyResult:
    """Check every copy of one checkpoint (on ``tiers``, default all), record and announce each verdict.
    ``budget`` bounds the reads (default ``Budget()``); copies it did not reach are ``unchecked``."""
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    return _verify(
        cat, ck, lineage.get_run_by_id(cat, ck.run_id).name, notify, deep, tiers, budget or Budget()
    )


def _unchecked(c: CopyCheck) -> bool:
    return any(f.problem is Problem.UNCHECKED for f in c.findings)


def _verify(
    cat: Catalog,
    ck: Checkpoint,
    run: str,
    notify: Notifier,
    deep: bool,
    tiers: Collection[str] | None,
    budget: Budget,
) -> VerifyResult:
    check = scrub(cat, ck, deep=deep, tiers=tiers, budget=budget)
    result = VerifyResult(run, str(ck.manifest_digest), ck.path, check)
    notify.log(
        logging.INFO,
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
            notify.event(run_event("rewind.copy.corrupt", run, payload, step=ck.step, checkpoint_id=ck.id))
    if result.status is CheckpointStatus.CORRUPT and check.copies:
        announce_corrupt(
            notify, run=run, step=ck.step, checkpoint_id=ck.id, path=ck.path, findings=result.findings
        )
    unreadable = any(
        c.verdict is Verdict.UNVERIFIABLE for c in check.copies
    )  # proven only when all were read
    if deep and result.status is CheckpointStatus.VERIFIED and not unreadable:
        notify.event(
            run_event("rewind.checkpoint.verified", run, result.as_dict(), step=ck.step, checkpoint_id=ck.id)
        )
    return result


def verify_run(
    cat: Catalog,
    *,
    run: str,
    notify: Notifier,
    step: int | None = None,
    deep: bool = True,
    tiers: Collection[str] | None = None,
    budget: Budget | None = None,
) -> list[VerifyResult]:
    """Verify a run's committed checkpoints (or the one at ``step``); a checkpoint condemned earlier with
    nothing left to look at is history, not news, and is left out. One ``budget`` (default ``Budget()``)
    bounds the whole run's checks: spent, what is left is reported ``unchecked``."""
    budget = budget or Budget()
    targets = [ck for ck in lineage.checkpoints(cat, run, step) if ck.status in CHECKABLE]
    if not targets:
        raise RewindError(
            f"run {run!r} has no committed checkpoint" + (f" at step {step}" if step is not None else "")
        )
    # checked least recently checked first (a budget that stops it leaves the freshest), shown in step order
    order = {c.id: staleness(c) for c in copies.worth_checking(cat, lineage.get_run(cat, run).id)}
    checked = sorted(targets, key=lambda ck: order.get(ck.id, (2, 0.0, ck.step, ck.id)))
    results = sorted(
        (_verify(cat, ck, run, notify, deep, tiers, budget) for ck in checked), key=lambda r: r.step
    )
    kept = [r for r in results if r.copies or r.status is not CheckpointStatus.CORRUPT]
    if not kept:
        raise RewindError(
            f"run {run!r} has no copy" + (f" on the {', '.join(tiers)} tier" if tiers else "") + " to check"
        )
    return kept


def worth_checking(cat: Catalog, *, run: str | None = None) -> list[tuple[str, int, int]]:
    """(run, step, checkpoint id) of what a scrub checks (committed, verified, or corrupt with a copy left),
    the least recently checked first: a scrub its budget stops part-way resumes, next time, where the
    previous one did not get to."""
    runs = [run] if run else [r["run"] for r in lineage.list_runs(cat)]
    found = [(c, name) for name in runs for c in copies.worth_checking(cat, lineage.get_run(cat, name).id)]
    return [(name, c.step, c.id) for c, name in sorted(found, key=lambda f: staleness(f[0]))]


def staleness(c: copies.Checkable) -> tuple[int, float, int, int]:
    """The order a scrub checks in: never checked first, then the longest unchecked; a tie in step order."""
    at = aware(c.oldest) if c.oldest is not None else None
    return (0 if c.never or at is None else 1, at.timestamp() if at else 0.0, c.step, c.id)


def announce_corrupt(
    notify: Notifier,
    *,
    run: str,
    step: int,
    checkpoint_id: int,
    path: str,
    findings: Sequence[Finding | Mapping[str, str]],
) -> None:
    """The findings table and the ``rewind.checkpoint.corrupt`` event of a checkpoint that failed verification."""
    rows = [f.as_dict() if isinstance(f, Finding) else dict(f) for f in findings]
    notify.table(
        key=artifact_key("rewind", run, "corrupt", step),
        rows=rows,
        description=f"Checkpoint {run} step {step} failed verification: {path}",
    )
    payload = {"step": step, "checkpoint_id": checkpoint_id, "path": path, "findings": rows}
    notify.event(run_event("rewind.checkpoint.corrupt", run, payload, step=step, checkpoint_id=checkpoint_id))
