"""Planning a restore: which checkpoints to try, newest first, and each one's copies, nearest first.

A pure read of the catalog, like litestream's restore plan: nothing on any tier is
touched, so a plan can be shown before it is executed. Candidates are the run's
committed and verified checkpoints, and corrupt ones that still have a copy that
could verify (a scrub that condemned a local copy says nothing about a replica).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Select, select

from rewind.infra.catalog import copies, disks, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import NotFoundError

log = logging.getLogger("rewind.restore")
_STATUS_RANK = {R.VERIFIED.value: 0, R.PENDING.value: 1, R.UNVERIFIABLE.value: 2}


@dataclass(frozen=True, slots=True)
class Copy:
    replica_id: int
    tier: str  # memory | local | shared | offsite
    uri: str  # memory, local: the directory; otherwise the tier's root
    key: str | None  # below ``uri`` for a remote copy
    status: str

    @property
    def local(self) -> bool:
        """A directory this machine reads in place: on its local tier or in its memory tier."""
        return self.tier in disks.DIRECTORY_TIERS

    def where(self) -> str:
        return self.uri if self.local else f"{self.uri.rstrip('/')}/{self.key}"


@dataclass(frozen=True, slots=True)
class Candidate:
    checkpoint_id: int
    run: str
    step: int
    status: str
    manifest_digest: str
    total_bytes: int
    copies: tuple[Copy, ...]
    elsewhere: tuple[str, ...] = ()  # hosts holding local copies this machine cannot read
    ring: tuple[tuple[str, str], ...] = ()  # (holder, source): a host's memory holding another host's share


@dataclass(frozen=True, slots=True)
class RestoreTarget:
    """The restore point a recovery chose, as its handoff carries it to the job: the job must load this
    checkpoint (or, should its bytes fail as the job reads them, the newest older one that proves itself)."""

    checkpoint_id: int
    step: int
    manifest_digest: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "manifest_digest": self.manifest_digest,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> RestoreTarget | None:
        if not isinstance(raw, dict):
            return None
        try:
            return cls(int(raw["checkpoint_id"]), int(raw["step"]), str(raw["manifest_digest"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class RestorePlan:
    run: str
    root: Path  # the local tier: where a copy fetched from another tier is written
    candidates: tuple[Candidate, ...]
    exact: bool  # one checkpoint was asked for: its failure is not followed by an older one

    def describe(self) -> list[str]:
        return [
            f"step {c.step} ({c.status}): " + ", ".join(f"{p.tier} [{p.status}]" for p in c.copies)
            for c in self.candidates
        ]


def _copies(
    rows: list[copies.CopyRow], tiers: Collection[str] | None
) -> tuple[tuple[Copy, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The usable copies this machine can read, nearest first, the hosts of those on disks it cannot, and
    the peer ring's copies (holder, source host): shares, never read as a whole copy."""
    usable: list[Copy] = []
    away: list[str] = []
    ring: list[tuple[str, str]] = []
    for r in rows:
        if r.status not in copies.USABLE_VALUES or (tiers is not None and r.tier not in tiers):
            continue
        source = disks.ring_source(r.tier, r.key)
        if source is not None:
            ring.append((str(r.host or r.tier_id), source))
        elif disks.elsewhere(r.tier, r.tier_id, r.uri):  # on another host's disk
            away.append(str(r.host or r.tier_id))
        else:
            usable.append(Copy(r.replica_id, r.tier, r.uri, r.key, r.status))
    usable.sort(key=lambda c: (copies.TIER_ORDER.get(c.tier, 9), _STATUS_RANK.get(c.status, 9)))
    return tuple(usable), tuple(away), tuple(ring)


def _candidates(
    run_id: int, step: int | None, before_step: int | None, checkpoint_id: int | None
) -> Select[Any]:
    """The run's checkpoints worth a look, as a query: read once for the rows, once as a subquery for copies."""
    q = select(Checkpoint.id).where(
        Checkpoint.run_id == run_id,
        Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value, S.CORRUPT.value]),
        Checkpoint.manifest_digest.is_not(None),
    )
    if checkpoint_id is not None:
        q = q.where(Checkpoint.id == checkpoint_id)
    if step is not None:
        q = q.where(Checkpoint.step == step)
    if before_step is not None:
        q = q.where(Checkpoint.step < before_step)
    return q


_COLUMNS = (
    Checkpoint.id,
    Checkpoint.step,
    Checkpoint.status,
    Checkpoint.status_reason,
    Checkpoint.manifest_digest,
    Checkpoint.total_bytes,
)


def _candidate(
    r: Any, run: str, rows: list[copies.CopyRow], tiers: Collection[str] | None
) -> Candidate | None:
    """The checkpoint of row ``r`` (``_COLUMNS``) with its copies, or None when it is no candidate."""
    found, away, ring = _copies(rows, tiers)
    if r.status == S.CORRUPT.value and (not found or copies.is_condemned(r.status, r.status_reason)):
        return None  # condemned for good, or nothing left that could verify
    if tiers is not None and not found:
        return None  # not on the tiers asked for: not a candidate there, and not "missing" either
    status, digest = str(r.status), str(r.manifest_digest)
    return Candidate(r.id, run, r.step, status, digest, r.total_bytes or 0, found, away, ring)


def plan(
    cat: Catalog,
    run: str,
    *,
    root: Path,
    step: int | None = None,
    before_step: int | None = None,
    checkpoint_id: int | None = None,
    tiers: Collection[str] | None = None,
    target: RestoreTarget | None = None,
) -> RestorePlan:
    """Candidates newest first: exactly ``step`` (or one checkpoint), or any step below ``before_step``, or all.

    ``target`` (a recovery's choice): its checkpoint first, then older ones; a newest candidate that is
    not the target (the catalog changed since the recovery chose it) is logged, and the catalog wins.

    ``tiers`` limits the copies to those tiers (``rewind ckpt restore --from shared``). Three statements
    whatever the run's length: the run, its candidates (columns only), and all their usable copies.
    """
    run_id = lineage.get_run(cat, run).id
    if target is not None:
        before_step = target.step + 1 if before_step is None else min(before_step, target.step + 1)
    ids = _candidates(run_id, step, before_step, checkpoint_id)
    with cat.session() as s:
        rows = s.execute(
            ids.with_only_columns(*_COLUMNS).order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        ).all()
    by_id = copies.copy_rows(cat, ids, statuses=copies.USABLE_VALUES)
    candidates = [c for r in rows if (c := _candidate(r, run, by_id.get(r.id, []), tiers)) is not None]
    if target is not None:
        _warn_if_not(target, run, candidates)
    exact = step is not None or checkpoint_id is not None
    if exact and not candidates:
        what = f"step {step}" if step is not None else f"checkpoint {checkpoint_id}"
        where = f" with a copy on the {', '.join(tiers)} tier" if tiers else ""
        raise NotFoundError(f"run {run!r} has no restorable checkpoint at {what}{where}")
    return RestorePlan(run, Path(root).expanduser().resolve(), tuple(candidates), exact)


def _warn_if_not(target: RestoreTarget, run: str, candidates: list[Candidate]) -> None:
    """The catalog changed since a recovery chose ``target``: the catalog wins, and it is said."""
    first = candidates[0] if candidates else None
    if first is None or (first.checkpoint_id, first.manifest_digest) == (
        target.checkpoint_id,
        target.manifest_digest,
    ):
        return
    log.warning(
        "run %s: the restore point handed over (checkpoint %d, step %d) is not the newest the catalog "
        "offers now (checkpoint %d, step %d): loading the catalog's",
        run, target.checkpoint_id, target.step, first.checkpoint_id, first.step,
    )  # fmt: skip
