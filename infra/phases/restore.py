"""Phase 6, restore: the newest good checkpoint (or a chosen one), from the nearest good copy.

``restore_point`` plans (``restore.plan``) and executes (``restore.execute``) a restore
into the local tier, held to the catalog (every byte hashed, or, for a job that hashes every byte as
it loads, the manifest, the sizes and the training state: then a copy on another tier is only peeked at,
and a checkpoint whose copies are all on the disks of the job's hosts, which this machine cannot see, is
chosen on the catalog's word, for the job to prove on those hosts); ``roll_back`` then makes the
restore point the run's head (newer checkpoints retired), so the next launch resumes from
it. What was skipped as damaged is announced like a failed verification; the restore is
announced as ``rewind.restore.completed`` with a markdown summary.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from rewind.infra import config, progress
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus
from rewind.infra.errors import CorruptCheckpoint, NoRestorableCheckpoint
from rewind.infra.format import manifest as mf
from rewind.infra.format import payload
from rewind.infra.format.verify import Finding, verify_files
from rewind.infra.phases.notify import Notifier, artifact_key, run_event
from rewind.infra.phases.verify import announce_corrupt
from rewind.infra.restore import execute, plan
from rewind.infra.restore.execute import Skip
from rewind.infra.restore.plan import RestoreTarget

_DAMAGED = (execute.SkipOutcome.CORRUPT, execute.SkipOutcome.MISSING, execute.SkipOutcome.UNLOADABLE)


class Proof(StrEnum):
    """How much of the restore point this phase reads."""

    BYTES = "bytes"  # every byte hashed here: the directory is handed to a reader that trusts it
    MANIFEST = "manifest"  # the manifest held to the catalog's digest and the sizes checked: for a job
    # that hashes every byte as it loads (a recovery), so the restore point is read once, not twice


@dataclass(frozen=True, slots=True)
class DataPosition:
    """Where the job's data loader was at the restore point."""

    epoch: int
    consumed: int
    total: int


@dataclass(frozen=True, slots=True)
class RestorePoint:
    """A checkpoint in a local directory, proven as ``proof`` says (every byte, or the manifest for a job
    that hashes every byte as it loads), and what was passed over to get it."""

    run: str
    step: int
    checkpoint_id: int
    manifest_digest: str
    path: str  # the copy chosen: a local directory, another tier's copy, or the hosts whose disks hold it
    source: str  # the tier of the copy used
    fetched: bool  # downloaded into the local tier for this restore
    seconds: float
    skipped: tuple[Skip, ...]
    retired_checkpoint_ids: tuple[int, ...]
    data: DataPosition | None  # None: not read (its copies are on other hosts' disks)
    proof: Proof
    bytes_read: int  # of the checkpoint's data, by this phase (hashed or downloaded)

    @property
    def target(self) -> RestoreTarget:
        """What a relaunched job is handed: load exactly this checkpoint."""
        return RestoreTarget(self.checkpoint_id, self.step, self.manifest_digest)

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "manifest_digest": self.manifest_digest,
            "path": self.path,
            "source": self.source,
            "fetched": self.fetched,
            "seconds": round(self.seconds, 3),
            "skipped": [{"step": s.step, "outcome": s.outcome, "why": s.reason} for s in self.skipped],
            "retired_checkpoint_ids": list(self.retired_checkpoint_ids),
            "data": (
                None
                if self.data is None
                else {"epoch": self.data.epoch, "consumed": self.data.consumed, "total": self.data.total}
            ),
            "proof": self.proof.value,
            "bytes_read": self.bytes_read,
        }


def _announce_chosen_corrupt(notify: Notifier, p: plan.RestorePlan, exc: CorruptCheckpoint) -> None:
    """One checkpoint was asked for and it is damaged on every copy: say so (an older one is not tried)."""
    if p.exact and p.candidates:
        chosen = p.candidates[0]
        announce_corrupt(
            notify, run=p.run, step=chosen.step, checkpoint_id=chosen.checkpoint_id, path=exc.location,
            findings=exc.findings,
        )  # fmt: skip


def restore_point(
    cat: Catalog,
    *,
    run: str,
    notify: Notifier,
    step: int | None = None,
    before_step: int | None = None,
    roll_back: bool = False,
    reason: str = "",
    tiers: Collection[str] | None = None,
    root: Path | None = None,
    proof: Proof = Proof.BYTES,
    lost_hosts: Collection[str] = (),
) -> RestorePoint:
    """A verified local copy of the restore point (fetched from another tier if need be).

    ``step``: exactly that checkpoint (damaged on every copy: ``CorruptCheckpoint``, announced);
    ``before_step``: the newest one before it; ``tiers``: only copies on these; ``roll_back``:
    retire the checkpoints after it; ``proof``: every byte hashed here, or (a recovery, whose job
    hashes every byte as it loads) the manifest and sizes only; ``lost_hosts``: hosts gone with their
    disks (a checkpoint held only there is passed over).
    """
    p = plan.plan(
        cat, run, root=root or config.checkpoint_root(), step=step, before_step=before_step, tiers=tiers
    )
    if not p.candidates and tiers:
        raise NoRestorableCheckpoint(
            f"run {run!r} has no restorable checkpoint with a copy on the {', '.join(tiers)} tier "
            "(rewind status shows where its copies are)",
            (),
        )
    away = _on_other_hosts(p, set(lost_hosts)) if proof is Proof.MANIFEST else None
    if away is not None:
        point = _catalogs_word(cat, p.run, away, roll_back=roll_back, reason=reason)
        _announce(notify, point)
        return point
    # The loader reads the data position through verification, inside the executor: a damaged training
    # state is that copy's failure (recorded, quarantined, an older checkpoint tried), like any other.
    load = _every_byte if proof is Proof.BYTES else _position
    try:
        with (
            progress.tallied() as read,
            execute.restoring(cat, p, load, quick=proof is Proof.MANIFEST) as done,
        ):
            retired = _roll_back(cat, run, done.step, reason) if roll_back else []
    except CorruptCheckpoint as exc:  # the step the caller chose is damaged on every copy
        _announce_chosen_corrupt(notify, p, exc)
        raise
    _announce_skipped(notify, run, done.skipped)
    digest = lineage.get_checkpoint(cat, done.checkpoint_id).manifest_digest
    point = RestorePoint(
        run, done.step, done.checkpoint_id, str(digest), done.where, done.source, done.fetched,
        done.seconds, done.skipped, tuple(retired), done.value, proof, read.bytes,
    )  # fmt: skip
    _announce(notify, point)
    return point


def _roll_back(cat: Catalog, run: str, step: int, reason: str) -> list[int]:
    why = reason or f"rolled back to step {step}"
    return lineage.supersede_after(cat, lineage.get_run(cat, run).id, step, why)


def _on_other_hosts(p: plan.RestorePlan, lost: set[str]) -> plan.Candidate | None:
    """The newest candidate, when no copy of it is readable here but its local copies are all on other
    hosts' disks that are not lost, or held in the memory of a host that is not (the peer ring: a lost
    host's share); None when the newest worth trying has a copy here (the executor's way)."""
    for c in p.candidates:
        if c.copies:
            return None
        kept = {source for holder, source in c.ring if holder not in lost}
        if c.status != CheckpointStatus.CORRUPT and c.elsewhere and not (set(c.elsewhere) & lost) - kept:
            return c
    return None


def _catalogs_word(
    cat: Catalog, run: str, cand: plan.Candidate, *, roll_back: bool, reason: str
) -> RestorePoint:
    """The restore point chosen on the catalog's record alone: the job, on the hosts holding its copies,
    hashes every byte as it loads (and falls back to an older checkpoint should they fail)."""
    retired = _roll_back(cat, run, cand.step, reason) if roll_back else []
    where = f"the disks of host(s) {', '.join(sorted(set(cand.elsewhere)))}" + (
        f" and the memory of host(s) {', '.join(sorted({h for h, _ in cand.ring}))}" if cand.ring else ""
    )
    return RestorePoint(
        run, cand.step, cand.checkpoint_id, cand.manifest_digest, where, "local", False, 0.0, (),
        tuple(retired), None, Proof.MANIFEST, 0,
    )  # fmt: skip


def _announce_skipped(notify: Notifier, run: str, skipped: tuple[Skip, ...]) -> None:
    """Each checkpoint passed over as damaged, announced as a failed verification."""
    for s in skipped:
        if s.outcome in _DAMAGED:
            findings: list[Finding | dict[str, str]] = [*s.findings] or [
                {"problem": s.outcome, "path": "", "detail": s.reason}
            ]
            announce_corrupt(
                notify, run=run, step=s.step, checkpoint_id=s.checkpoint_id, path="", findings=findings
            )


def _position(directory: Path, manifest: mf.Manifest) -> DataPosition:
    """The loader of a manifest-only restore: the data loader's position, its file hashed as it is read;
    the rest of the bytes are left for the job that loads them."""
    return DataPosition(**payload.data_position(directory, manifest))


def _every_byte(directory: Path, manifest: mf.Manifest) -> DataPosition:
    verify_files(directory, manifest)
    return _position(directory, manifest)


def _announce(notify: Notifier, point: RestorePoint) -> None:
    notify.log(
        logging.INFO,
        "restore point of %s: step %d from the %s copy (%s), %s in %.2fs; skipped %d",
        point.run, point.step, point.source, "downloaded" if point.fetched else "in place",
        "every byte verified" if point.proof is Proof.BYTES or point.fetched else "manifest verified",
        point.seconds, len(point.skipped),
    )  # fmt: skip
    how = (
        f"downloaded from the {point.source} tier"
        if point.fetched
        else "its manifest checked here, the job fetches it"
        if point.data is not None and point.source != "local"
        else "on its hosts' own disks, for the job to prove"
        if point.data is None
        else "the local copy"
    )
    lines = [
        f"# Restore of `{point.run}`",
        "",
        f"Restore point: **step {point.step}** ({how}, `{point.path}`)",
        "",
    ]
    lines += [f"- skipped {s}" for s in point.skipped] or ["- no checkpoint skipped"]
    if point.retired_checkpoint_ids:
        lines.append(f"- retired {len(point.retired_checkpoint_ids)} newer checkpoint(s) (rolled back)")
    notify.markdown(key=artifact_key("rewind", point.run, "restore"), text="\n".join(lines))
    event = run_event(
        "rewind.restore.completed",
        point.run,
        point.as_dict(),
        step=point.step,
        checkpoint_id=point.checkpoint_id,
    )
    notify.event(event)
