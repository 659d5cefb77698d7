"""Checking every copy of a checkpoint where it lies, and recording what each check found.

The scrub's counterpart of the restore executor: the same checks (the catalog's
manifest digest first, then sizes, then, when deep, every byte), the same verdicts
per copy, the same settling of the checkpoint's status. A damaged local copy is
moved to ``.quarantine/``; an I/O error leaves a copy unverifiable and the
checkpoint as it was; a check that passes restores what an earlier one took away. A local copy on
another host's disk (``infra/format/local_tier.py``) is left to a machine that sees that disk: neither
missing nor checked here (``elsewhere``, by the host that marked the disk).

A scrub spends at most its ``Budget`` (time, and bytes read; one may be shared by
the scrubs of a whole run): once it is spent, the copies not checked yet are
reported ``unchecked`` (unverifiable, nothing recorded) and it says how many.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from rewind.infra import config
from rewind.infra.catalog import copies, disks, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, Replica
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.format import keyring as kr
from rewind.infra.format import store
from rewind.infra.format.verify import Budget, BudgetSpent, Finding, Problem, Report, Verdict, check_copy
from rewind.infra.tiers import open_tier, transfer
from rewind.infra.tiers.base import UNREADABLE_ERRORS

log = logging.getLogger("rewind.scrub")
QUARANTINE = store.QUARANTINE


@dataclass(frozen=True, slots=True)
class CopyCheck:
    tier: str
    where: str
    verdict: Verdict
    findings: tuple[Finding, ...]


@dataclass(frozen=True, slots=True)
class CheckpointCheck:
    checkpoint_id: int
    step: int
    status: str  # the checkpoint's status after the check
    deep: bool
    copies: tuple[CopyCheck, ...]
    # local copies on other machines this one cannot see (their hosts): left to them, judged neither way
    elsewhere: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return bool(self.copies) and all(c.verdict is Verdict.VERIFIED for c in self.copies)

    @property
    def findings(self) -> list[Finding]:
        return [f for c in self.copies for f in c.findings]

    @property
    def unchecked(self) -> int:
        """Copies the budget ran out before (unverifiable, nothing recorded about them)."""
        return sum(any(f.problem is Problem.UNCHECKED for f in c.findings) for c in self.copies)


def _check(
    rep: Replica, run: str, step: int, digest: str, deep: bool, ring: kr.Keyring, budget: Budget
) -> Report:
    budget.check()
    if rep.tier in disks.DIRECTORY_TIERS:
        return check_copy(Path(rep.uri), digest, deep=deep, keyring=ring, budget=budget)
    key = rep.key or transfer.copy_key(run, step)
    try:
        return transfer.check_remote(open_tier(rep.uri), key, digest, deep=deep, keyring=ring, budget=budget)
    except UNREADABLE_ERRORS as exc:
        finding = Finding(Problem.UNREADABLE, ".", str(exc))
        return Report(Path(f"{rep.uri}/{key}"), None, (finding,), deep)


def _record(cat: Catalog, rep: Replica, report: Report) -> None:
    verdict = report.verdict
    detail = "; ".join(str(f) for f in report.findings if f.fatal)[:2000] or None
    if verdict is Verdict.VERIFIED and not report.deep:
        if rep.status in (R.UNVERIFIABLE.value, R.MISSING.value, R.CORRUPT.value):
            copies.record(cat, rep.id, R.PENDING, "quick check passed")  # proven again only by a deep one
        return
    moved = None
    owned = rep.tier == copies.LOCAL and store.owned(report.directory, config.checkpoint_root())
    if verdict is Verdict.CORRUPT and owned:
        with contextlib.suppress(OSError):
            moved = str(store.quarantine(report.directory, "corrupt"))
    copies.record(cat, rep.id, R(verdict.value), detail, uri=moved)


def _in_quarantine(rep: Replica) -> bool:
    return rep.tier == copies.LOCAL and QUARANTINE in Path(rep.uri).parts


def scrub(
    cat: Catalog,
    ck: Checkpoint,
    *,
    deep: bool,
    tiers: Collection[str] | None = None,
    keyring: kr.Keyring | None = None,
    budget: Budget | None = None,
) -> CheckpointCheck:
    """Check the copies of ``ck`` (on ``tiers``, default all), record each verdict, settle its status.

    ``budget``: what the checks may spend (default: ``Budget()``, hours; pass one to several scrubs to bound
    them together). Spent, the copies left are reported unchecked, and a warning says how many.
    """
    ring = keyring if keyring is not None else kr.from_env()
    budget = budget if budget is not None else Budget()
    run = lineage.get_run_by_id(cat, ck.run_id).name
    results = []
    spent = None
    away: list[str] = []
    for rep in copies.copies_of(cat, [ck.id])[ck.id]:
        if (
            rep.status == R.DELETED.value
            or _in_quarantine(rep)
            or (tiers is not None and rep.tier not in tiers)
        ):
            continue
        if disks.ring_source(rep.tier, rep.key) is not None:  # one host's share in another's memory: proven
            continue  # file by file when a restore takes it, never judged as a whole copy
        if disks.elsewhere(rep.tier, rep.tier_id, rep.uri):  # only a machine that sees its disk judges it
            away.append(str(rep.host or rep.tier_id))
            continue
        where = (
            rep.uri
            if rep.tier in disks.DIRECTORY_TIERS
            else f"{rep.uri}/{rep.key or transfer.copy_key(run, ck.step)}"
        )
        try:
            report = _check(rep, run, ck.step, str(ck.manifest_digest), deep, ring, budget)
        except BudgetSpent as exc:  # nothing is known about this copy: nothing is recorded
            spent = str(exc)
            left = Finding(Problem.UNCHECKED, ".", f"{exc}: not checked")
            results.append(CopyCheck(rep.tier, where, Verdict.UNVERIFIABLE, (left,)))
            continue
        _record(cat, rep, report)
        results.append(CopyCheck(rep.tier, where, report.verdict, report.findings))
    status = copies.settle(cat, ck.id)
    check = CheckpointCheck(ck.id, ck.step, status, deep, tuple(results), tuple(away))
    if spent is not None:
        log.warning("%s step %d: scrub %s, %d left unchecked", run, ck.step, spent, check.unchecked)
    return check
