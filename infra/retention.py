"""Retention that keeps what restores, and reclaims what never will.

``keep_last`` counts *verified* checkpoints: a committed one nobody has proven
does not stand in for one that was, and a corrupt one counts for nothing. Before
planning, the newest committed checkpoints are deep-verified until ``keep_last``
verified ones exist, so a run that was never scrubbed is not emptied either.
Checkpoints newer than the newest verified one are never removed (they are
progress not yet proven), nor pinned ones, nor ones a serving version needs.

The plan deletes nothing (proving the newest checkpoints records verdicts, as any
check does). Each deletion is re-checked in one guarded statement
(:func:`leases.delete_guarded`: no restore lease, still restorable, not pinned,
not serving, enough newer verified checkpoints), so a plan made before a
roll-back cannot delete the step the roll-back chose. The catalog reference goes
first, then the bytes, manifest first on every tier; a copy whose bytes could not
be removed (an error, a SIGKILL) stays listed, its checkpoint already ``deleted``
(so nothing restores from it), and the next run finishes it.

Dead copies (of superseded, aborted or corrupt checkpoints) and ``.quarantine/``
directories are reclaimed once older than ``grace_s`` (never a live checkpoint a failed save moved aside);
what is left of checkpoints retention itself deleted goes at the next run.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from sqlalchemy import exists, select

from rewind.infra import config, progress
from rewind.infra.catalog import copies, disks, leases, lineage, locations, serving
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, CheckpointStatus, Replica, utcnow
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint import displaced
from rewind.infra.errors import ConfigError, RewindError
from rewind.infra.faults import fault_point
from rewind.infra.format import manifest as mf
from rewind.infra.format import store
from rewind.infra.format.verify import Budget, Verdict
from rewind.infra.memory import keeper
from rewind.infra.restore.scrub import QUARANTINE, scrub
from rewind.infra.tiers import open_tier, transfer

log = logging.getLogger("rewind.gc")
S = CheckpointStatus
DEAD = (S.SUPERSEDED, S.ABORTED, S.DELETED, S.CORRUPT)
LIVE = (S.COMMITTED.value, S.VERIFIED.value)


@dataclass(frozen=True, kw_only=True)
class Policy:
    keep_last: int = 3
    """The newest N verified checkpoints are kept (at least 1: the one a restart would use)."""
    keep_every: int = 0
    """Checkpoints whose step is a multiple of K are kept as well (0: none)."""
    byte_budget: int | None = None
    """If set, the oldest checkpoints kept only by ``keep_every`` go until the local bytes fit."""
    grace_s: float = 7 * 86400.0
    """Copies of dead checkpoints and quarantined directories older than this are reclaimed."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError("keep_last must be at least 1: the newest checkpoint is what a restart needs")
        if self.keep_every < 0 or (self.byte_budget is not None and self.byte_budget < 0) or self.grace_s < 0:
            raise ConfigError("keep_every, byte_budget and grace cannot be negative")


@dataclass(frozen=True, slots=True)
class CopyRef:
    replica_id: int
    tier: str
    uri: str
    key: str | None
    status: str
    tier_id: str | None = None  # a local copy's disk


@dataclass
class Removal:
    checkpoint_id: int
    step: int
    bytes: int
    copies: list[CopyRef]


@dataclass
class GcPlan:
    run: str
    keep: list[int]
    remove: list[Removal] = field(default_factory=list)
    reclaim: list[Removal] = field(default_factory=list)  # copies of dead checkpoints
    quarantine: list[Path] = field(default_factory=list)
    verified_first: list[int] = field(default_factory=list)  # steps deep-verified before planning

    @property
    def freed_bytes(self) -> int:
        return sum(r.bytes * len(r.copies) for r in (*self.remove, *self.reclaim))


class Live(NamedTuple):
    """A restorable checkpoint as retention weighs it (columns, not an ORM row: a run has thousands)."""

    id: int
    step: int
    status: str
    pinned: bool
    total_bytes: int | None


def _live(cat: Catalog, run_id: int) -> list[Live]:
    """Committed or verified checkpoints of the run, newest step first (as ``lineage.restorable``)."""
    with cat.session() as s:
        rows = s.execute(
            select(
                Checkpoint.id, Checkpoint.step, Checkpoint.status, Checkpoint.pinned, Checkpoint.total_bytes
            )
            .where(Checkpoint.run_id == run_id, Checkpoint.status.in_(LIVE))
            .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        )
        return [Live(*r) for r in rows]


class Proof(NamedTuple):
    checked: list[int]  # the steps checked now, newest first
    sure: bool  # False: a check could not be made (an I/O error), so nothing older may go


def _proves_now(cat: Catalog, checkpoint_id: int) -> bool | None:
    """Whether the checkpoint restores *now*: its filesystem copies re-read byte for byte, else an off-site
    copy whose server checksums were just compared. None: a copy could not be read, or the scrub's budget
    (one for both looks) ran out before it was (say nothing yet: nothing older goes)."""
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    budget = Budget()
    near = scrub(cat, ck, deep=True, tiers=(copies.LOCAL, "shared"), budget=budget)
    if any(c.verdict is Verdict.VERIFIED for c in near.copies):
        return True
    far = scrub(cat, ck, deep=False, tiers=("offsite",), budget=budget)
    if any(c.verdict is Verdict.VERIFIED for c in far.copies):
        return True
    return None if any(c.verdict is Verdict.UNVERIFIABLE for c in (*near.copies, *far.copies)) else False


def prove_newest(cat: Catalog, live: list[Live], keep_last: int) -> Proof:
    """Prove, now, the newest checkpoints until ``keep_last`` of them restore: a proof recorded earlier
    (a copy may have rotted since) is never what retention deletes older checkpoints on."""
    proven, checked = 0, []
    for ck in live:
        if proven >= keep_last:
            break
        checked.append(ck.step)
        ok = _proves_now(cat, ck.id)
        if ok is None:
            return Proof(checked, False)
        proven += ok
    return Proof(checked, True)


def _refs(rows: list[copies.CopyRow]) -> list[CopyRef]:
    return [
        CopyRef(r.replica_id, r.tier, r.uri, r.key, r.status, r.tier_id)
        for r in rows
        if r.status != R.DELETED.value
    ]


def _kept(cat: Catalog, run_id: int, live: list[Live], policy: Policy) -> set[int]:
    verified = [c for c in live if c.status == S.VERIFIED]
    keep = {c.id for c in verified[: policy.keep_last]}
    if verified:
        keep |= {c.id for c in live if c.step > verified[0].step}  # progress not yet proven
    else:
        keep |= {c.id for c in live}  # nothing proven: nothing can be let go
    leased = leases.leased_in_run(cat, run_id)
    keep |= {c.id for c in live if c.pinned or c.id in leased}
    keep |= {c.id for c in live} & serving.protected_checkpoints(cat)
    by_every = [c for c in live if policy.keep_every and c.step % policy.keep_every == 0 and c.id not in keep]
    if policy.byte_budget is None:
        return keep | {c.id for c in by_every}
    total = sum((c.total_bytes or 0) for c in live if c.id in keep)
    for c in by_every:  # newest first: the oldest are the ones left out
        if total + (c.total_bytes or 0) <= policy.byte_budget:
            total += c.total_bytes or 0
            keep.add(c.id)
    return keep


def _dead(cat: Catalog, run_id: int, policy: Policy) -> list[Removal]:
    """Copies of checkpoints that can never be restored: past the grace period, or deleted already.

    A ``deleted`` checkpoint's copies are still listed only when the run that deleted it
    died or failed before its bytes were gone: the decision was made, no grace is owed.
    """
    cutoff = utcnow().timestamp() - policy.grace_s
    has_copy = exists().where(Replica.checkpoint_id == Checkpoint.id, Replica.status != R.DELETED.value)
    dead = select(Checkpoint.id).where(
        Checkpoint.run_id == run_id,
        Checkpoint.status.in_([d.value for d in DEAD]),
        Checkpoint.pinned.is_(False),
        has_copy,  # the history retention already emptied stays in the database
    )
    with cat.session() as s:
        rows = s.execute(
            dead.add_columns(
                Checkpoint.step,
                Checkpoint.status,
                Checkpoint.status_reason,
                Checkpoint.total_bytes,
                Checkpoint.updated_at,
                Checkpoint.created_at,
            ).order_by(Checkpoint.step, Checkpoint.id)
        ).all()
    by_id = copies.copy_rows(cat, dead)
    out = []
    for c in rows:
        if c.status != S.DELETED and (c.updated_at or c.created_at).timestamp() > cutoff:
            continue
        reps = by_id.get(c.id, [])
        usable = any(r.status in copies.USABLE_VALUES for r in reps)
        refs = _refs(reps)
        if refs and not (
            c.status == S.CORRUPT and usable and not copies.is_condemned(c.status, c.status_reason)
        ):
            out.append(Removal(c.id, c.step, c.total_bytes or 0, refs))
    return out


def _quarantined(cat: Catalog, run_id: int, root: Path, run: str, grace_s: float) -> list[Path]:
    """What lies aside past the grace period, but never a checkpoint the run still holds that a save of its
    step moved aside and could not put back yet (``displaced.superseded_live``)."""
    where = root / run / QUARANTINE
    if not where.is_dir():
        return []
    cutoff = time.time() - grace_s
    old = sorted(p for p in where.iterdir() if p.stat().st_mtime <= cutoff)
    held = set(displaced.superseded_live(cat, run_id, root / run))
    return [p for p in old if p not in held]


def plan(cat: Catalog, run: str, policy: Policy, *, root: Path | None = None) -> GcPlan:
    """What stays, what goes, and how many bytes that frees (after proving the newest checkpoints).

    A bounded number of statements whatever the run's length (plus one scrub per checkpoint it proves).
    """
    run_id = lineage.get_run(cat, run).id
    live = _live(cat, run_id)  # newest first
    proof = prove_newest(cat, live, policy.keep_last)
    live = _live(cat, run_id)  # the verdicts may have changed statuses
    keep = _kept(cat, run_id, live, policy) if proof.sure else {c.id for c in live}
    gone = [c for c in live if c.id not in keep]
    refs = copies.copy_rows(
        cat, select(Checkpoint.id).where(Checkpoint.run_id == run_id, Checkpoint.status.in_(LIVE))
    )
    out = GcPlan(run, sorted(c.step for c in live if c.id in keep), verified_first=proof.checked)
    out.remove = [Removal(c.id, c.step, c.total_bytes or 0, _refs(refs.get(c.id, []))) for c in gone]
    out.reclaim = _dead(cat, run_id, policy)
    out.quarantine = _quarantined(cat, run_id, Path(root or config.checkpoint_root()), run, policy.grace_s)
    return out


_moments = itertools.count(1)


def _moment() -> None:
    """One deletion step done: ``REWIND_FAULT=kill:gc.delete@N`` dies after this process's N-th."""
    fault_point("gc.delete", next(_moments))


def _delete_copies(cat: Catalog, run: str, r: Removal) -> None:
    for ref in r.copies:
        _delete_one(cat, run, r.step, ref)
        progress.advance(r.bytes)  # dealt with, whether freed now or left for the next run


def doomed(cat: Catalog, ref: CopyRef) -> bool:
    """Does this copy hold bytes of its own to delete (not missing, not where a wanted copy lies)?"""
    return ref.status != R.MISSING.value and not locations.location_in_use(cat, ref.replica_id)


def _delete_one(cat: Catalog, run: str, step: int, ref: CopyRef) -> None:
    if disks.elsewhere(ref.tier, ref.tier_id, ref.uri):  # another disk's: its own gc reclaims it (dead)
        return
    if locations.listed_at(cat, ref.replica_id) != (ref.uri, ref.key):
        return  # let go since the plan (another gc finished it: a new copy may lie there now), or moved (a
        # step saved again put it aside: a new checkpoint lies where it was): the next plan's, if anyone's
    if doomed(cat, ref):
        try:
            _delete_copy(ref, run, step)
        except Exception as exc:  # still listed: the next run tries again
            log.warning("could not delete %s copy of %s step %d at %s: %s", ref.tier, run, step, ref.uri, exc)
            return
    copies.mark_deleted(cat, ref.replica_id)
    _moment()


def execute(cat: Catalog, gc: GcPlan, policy: Policy) -> list[int]:
    """Remove what the plan says, each deletion re-checked; returns the steps actually removed.

    Order, so that a SIGKILL anywhere leaves nothing restorable pointing at missing bytes:
    the checkpoint leaves the catalog's restorable set (one guarded statement), then each
    copy's bytes go (manifest first), then the copy's row is let go.
    """
    removed = []
    with progress.phase(f"gc {gc.run}", gc.freed_bytes):
        for r in gc.remove:
            if not leases.delete_guarded(
                cat, r.checkpoint_id, keep_last=policy.keep_last, reason="retention policy"
            ):
                log.info(
                    "kept %s step %d: it is needed again (restored, pinned, or the newest verified)",
                    gc.run,
                    r.step,
                )
                progress.advance(r.bytes * len(r.copies))  # dealt with: kept
                continue
            _moment()
            _delete_copies(cat, gc.run, r)
            removed.append(r.step)
        for r in gc.reclaim:
            _delete_copies(cat, gc.run, r)
        for p in gc.quarantine:
            try:
                _remove_tree(p)
            except OSError as exc:
                log.warning("could not remove %s: %s", p, exc)
    return removed


def _remove_tree(path: Path) -> None:
    """Delete a local directory file by file, its manifest first: from then on no one takes it for a
    committed checkpoint (nor a chunked save for a link source). ``OSError`` leaves the rest for next time."""
    (path / mf.MANIFEST_NAME).unlink(missing_ok=True)
    _moment()
    if not path.exists():
        return
    for top, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(top, name))
            _moment()
        for name in dirs:
            sub = os.path.join(top, name)
            if os.path.islink(sub):
                os.unlink(sub)
            else:
                os.rmdir(sub)
    os.rmdir(path)


def _delete_copy(ref: CopyRef, run: str, step: int) -> None:
    if ref.tier == copies.MEMORY:  # this node's memory tier is Rewind's own; another node's goes with its row
        if not disks.elsewhere(ref.tier, ref.tier_id, ref.uri):
            keeper.remove(ref.uri)
        return
    if ref.tier == copies.LOCAL:
        path = Path(ref.uri)
        if store.owned(path, config.checkpoint_root()):  # never a directory Rewind did not write
            _remove_tree(path)
        return  # the row goes either way: the catalog stops counting on it
    t = open_tier(ref.uri)
    base = ref.key or transfer.copy_key(run, step)
    t.delete(f"{base}/{mf.MANIFEST_NAME}")
    _moment()
    for obj in list(t.list(f"{base}/")):
        t.delete(obj.key)
        _moment()
    try:  # parts of an upload cut short: invisible to a listing, kept (and billed) until aborted
        t.abandon(f"{base}/")
    except (
        RewindError
    ) as exc:  # a role without the right to list or abort them: the copy is gone all the same
        log.warning("%s/%s: unfinished uploads not aborted (%s)", ref.uri, base, exc)
