"""Executing a restore plan: the newest candidate with a copy that proves itself wins.

For each candidate, newest first, a restore lease is held (retention will not
delete it) and its copies are tried nearest first:

- a local copy is held to the catalog's manifest digest (paths, sizes, signature),
  then handed to the loader, which reads every byte once, hashing it, before
  anything is used;
- a copy on another tier is downloaded into the local tier first: its manifest is
  held to the catalog's digest before any data is fetched, every file must hash to
  its entry, and only then is the manifest written and the directory renamed in;
- ``quick`` (a recovery, whose job fetches and hashes every byte itself, wherever it runs): a copy on
  another tier is not downloaded: its manifest is held to the catalog's digest and only the training
  state is read (into a scratch directory, removed afterwards).

What a check finds is recorded against that copy (a damaged local copy is moved
to ``.quarantine/``); the checkpoint is corrupt only when no copy is left that
could verify, and an I/O error leaves it as it was (and stops the restore: an
older checkpoint is never chosen over one that may be good). A checkpoint whose bytes all
match but whose content cannot be decoded is condemned at once; one whose state
the job refuses is condemned only if an older one then loads (otherwise the job
changed, and nothing is condemned). A download that cannot be written into the local
tier (disk full, read-only) stops the restore with ``DiskWriteError``, recording
nothing against the copy it was reading: every other copy would need the same disk.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Generic, TypeVar

from rewind.infra.catalog import copies, disks, leases, moved_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import (
    CheckpointUnverifiable,
    CorruptCheckpoint,
    NoRestorableCheckpoint,
    NotFoundError,
    RewindError,
    StateMismatch,
    UnloadableCheckpoint,
)
from rewind.infra.format import keyring as kr
from rewind.infra.format import manifest as mf
from rewind.infra.format import payload, segments, store
from rewind.infra.format.verify import Finding, Problem, Verdict, check_copy, require, verdict_of
from rewind.infra.format.verify import partial as is_partial
from rewind.infra.restore.plan import Candidate, Copy, RestorePlan
from rewind.infra.tiers import fetch, open_tier, transfer
from rewind.infra.tiers.base import UNREADABLE_ERRORS, DiskWriteError, disk_write_error

log = logging.getLogger("rewind.restore")
T = TypeVar("T")
Loader = Callable[[Path, mf.Manifest], T]


class SkipOutcome(StrEnum):
    """Why a candidate was passed over."""

    CORRUPT = "corrupt"  # every copy that could be read was damaged
    UNVERIFIABLE = "unverifiable"  # a copy could not be read right now: says nothing about the bytes
    MISSING = "missing"  # no copy left (or the checkpoint was deleted since the plan)
    UNLOADABLE = "unloadable"  # its bytes were right but it could not be loaded
    MISMATCH = "mismatch"  # a state object refused it: it does not fit this job
    INCOMPLETE = "incomplete"  # spread over hosts' disks, and some disk's files are not at hand


@dataclass(frozen=True, slots=True)
class Skip:
    """A candidate passed over, and why."""

    step: int
    checkpoint_id: int
    outcome: SkipOutcome
    reason: str
    findings: tuple[Finding, ...] = ()

    def __str__(self) -> str:
        return f"step {self.step}: {self.outcome}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Restored(Generic[T]):
    checkpoint_id: int
    step: int
    directory: Path
    manifest: mf.Manifest
    source: str  # the tier of the copy used
    fetched: bool  # downloaded into the local tier for this restore
    value: T  # what the loader returned
    skipped: tuple[Skip, ...]
    seconds: float
    where: str  # the copy as a person finds it: the local directory, or another tier's copy only peeked at


@dataclass(frozen=True, slots=True)
class _Opened:
    directory: Path
    manifest: mf.Manifest
    local_replica_id: int | None  # None: no local copy (a peek at another tier's)
    fetched: bool
    scratch: bool = False  # a peek's directory: removed once the restore is done with it


def _fail(
    cat: Catalog,
    replica_id: int,
    directory: Path | None,
    verdict: Verdict,
    findings: list,
    root: Path,
    tier: str = copies.LOCAL,
) -> str:
    """Record a failed copy; a damaged local copy is moved aside so nothing can mistake it for good, a
    damaged memory copy removed (it is Rewind's own, and memory is scarce).

    Only directories under the local tier's root are moved: an adopted directory is the user's.
    """
    detail = "; ".join(str(f) for f in findings if f.fatal)[:2000] or verdict.value
    moved = None
    if verdict is Verdict.CORRUPT and directory is not None and tier == copies.MEMORY:
        shutil.rmtree(directory, ignore_errors=True)
    elif verdict is Verdict.CORRUPT and directory is not None and store.owned(directory, root):
        with contextlib.suppress(OSError):
            moved = str(store.quarantine(directory, "corrupt"))
    copies.record(cat, replica_id, R(verdict.value), detail, uri=moved)
    return detail


class ShareOnly(Exception):
    """A local copy holding only its disk's share of a checkpoint spread over hosts' disks, where every
    file is needed (by a loader that reads them all, or a sharded restore whose other disks' shares are
    not at hand): passed over for the next copy, recorded as nothing (it is not damaged)."""


def _peek(cand: Candidate, copy: Copy, ring: kr.Keyring) -> _Opened:
    """Another tier's copy, its manifest proven and its training state read, the rest left there."""
    key = copy.key or transfer.copy_key(cand.run, cand.step)
    try:
        scratch = Path(tempfile.mkdtemp(prefix="rewind-peek-"))
    except OSError as exc:  # this machine's temporary directory, not the copy
        raise disk_write_error(exc, f"the temporary directory {tempfile.gettempdir()}", copy.where()) from exc
    try:
        manifest = fetch.peek(
            open_tier(copy.uri), key, cand.manifest_digest, scratch, keyring=ring, paths={payload.STATE_FILE}
        )
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return _Opened(scratch, manifest, None, False, scratch=True)


def _drop(opened: _Opened | None) -> None:
    """A peek's scratch directory removed (nothing else is)."""
    if opened is not None and opened.scratch:
        shutil.rmtree(opened.directory, ignore_errors=True)


def _open(
    cat: Catalog, plan: RestorePlan, cand: Candidate, copy: Copy, ring: kr.Keyring, partial: bool, quick: bool
) -> _Opened:
    if quick and not copy.local:
        return _peek(cand, copy, ring)
    if copy.local:
        directory = Path(copy.uri)
        manifest = require(check_copy(directory, cand.manifest_digest, deep=False, keyring=ring))
        if not partial and is_partial(directory, manifest):
            raise ShareOnly(f"local copy at {directory} holds one host's share of the checkpoint")
        if copy.tier == copies.MEMORY:  # its files hashed a segment per core against the catalog's record
            manifest = segments.attach(
                manifest, copies.segments_of(cat, copy.replica_id, segments.MAX_RECORD)
            )
        return _Opened(directory, manifest, copy.replica_id, False)

    def displace(final: Path) -> None:  # what is there did not prove itself: kept, out of the way
        moved = store.quarantine(final, "displaced")
        moved_copies.moved(cat, str(final), str(moved), f"displaced by a copy from {copy.tier}")

    key = copy.key or transfer.copy_key(cand.run, cand.step)
    tier = open_tier(copy.uri)
    done = fetch.pull(tier, key, cand.manifest_digest, plan.root / cand.run, keyring=ring, displace=displace)
    copies.record(cat, copy.replica_id, R.VERIFIED, f"downloaded into {done.path}")
    rid = copies.set_local(cat, cand.checkpoint_id, str(done.path), R.PENDING, done.manifest.total_bytes)
    return _Opened(done.path, done.manifest, rid, True)


def _try(
    cat: Catalog,
    plan: RestorePlan,
    cand: Candidate,
    load: Loader[T],
    ring: kr.Keyring,
    *,
    quick: bool,
    partial: bool,
    whole: Callable[[], bool] = lambda: True,
) -> tuple[_Opened, T, Copy] | Skip:
    tried: list[str] = []
    verdicts: list[Verdict] = []
    found: list[Finding] = []
    shares = 0  # copies holding one disk's share, not completed
    for copy in cand.copies:
        opened: _Opened | None = None
        try:
            opened = _open(cat, plan, cand, copy, ring, partial, quick)
            value = load(opened.directory, opened.manifest)
        except ShareOnly as exc:
            tried.append(str(exc))
            shares += 1
            continue
        except StateMismatch as exc:  # every byte matched; the job refused the state
            _drop(opened)
            return Skip(cand.step, cand.checkpoint_id, SkipOutcome.MISMATCH, str(exc), tuple(exc.findings))
        except UnloadableCheckpoint as exc:
            _drop(opened)
            copies.condemn(cat, cand.checkpoint_id, "; ".join(str(f) for f in exc.findings))
            return Skip(cand.step, cand.checkpoint_id, SkipOutcome.UNLOADABLE, str(exc), tuple(exc.findings))
        except CorruptCheckpoint as exc:
            verdict, findings = verdict_of(exc.findings), list(exc.findings)
        except DiskWriteError as exc:  # the copy was being read fine: the disk it went to failed
            raise type(exc)(f"cannot restore {cand.run} step {cand.step}: {exc}") from exc
        except UNREADABLE_ERRORS as exc:
            verdict, findings = Verdict.UNVERIFIABLE, [Finding(Problem.UNREADABLE, copy.where(), str(exc))]
        else:
            if opened.local_replica_id is not None and (opened.fetched or (not quick and whole())):
                # a download hashed every byte; a quick open proved the manifest; a load that read some
                # files from a nearer copy (this node's memory) did not prove the local copy's
                copies.record(cat, opened.local_replica_id, R.VERIFIED, None, uri=str(opened.directory))
                if opened.fetched or copy.tier not in disks.VOLATILE_TIERS:  # a memory copy proves nothing
                    copies.settle(cat, cand.checkpoint_id)  # (settle leaves it out): no run lock taken
            return opened, value, copy
        _drop(opened)
        detail = _failed_copy(cat, plan, copy, opened, verdict, findings)
        tried.append(f"{copy.tier} {verdict.value} ({detail})")
        verdicts.append(verdict)
        found += [f for f in findings if f.fatal]
        log.warning(
            "step %d: %s copy at %s: %s: %s", cand.step, copy.tier, copy.where(), verdict.value, detail
        )
    copies.settle(cat, cand.checkpoint_id)
    away = (
        f"no copy here: its local copy is on a disk of host {', '.join(cand.elsewhere)} not seen here"
        if cand.elsewhere
        else ""
    )
    reason = "; ".join(tried + ([away] if away else [])) or "no copy left"
    return Skip(cand.step, cand.checkpoint_id, _outcome(verdicts, shares), reason, tuple(found))


def _failed_copy(
    cat: Catalog,
    plan: RestorePlan,
    copy: Copy,
    opened: _Opened | None,
    verdict: Verdict,
    findings: list[Finding],
) -> str:
    """Record what failed: the copy itself (or its download), or the local directory it produced."""
    if opened is None or opened.local_replica_id is None:
        where = Path(copy.uri) if copy.local else None
        return _fail(cat, copy.replica_id, where, verdict, findings, plan.root, copy.tier)
    # the copy opened in place (memory or local), or the local one a download made
    tier = copies.LOCAL if opened.fetched else copy.tier
    return _fail(cat, opened.local_replica_id, opened.directory, verdict, findings, plan.root, tier)


def _outcome(verdicts: list[Verdict], shares: int) -> SkipOutcome:
    """Why a candidate none of whose copies served was passed over (``shares``: copies that held one
    disk's share, not completed)."""
    if Verdict.UNVERIFIABLE in verdicts:
        return SkipOutcome.UNVERIFIABLE
    if verdicts and all(v is Verdict.MISSING for v in verdicts):
        return SkipOutcome.MISSING
    if shares and not verdicts:
        return SkipOutcome.INCOMPLETE
    return SkipOutcome.CORRUPT if verdicts else SkipOutcome.MISSING


def _give_up(plan: RestorePlan, skipped: list[Skip]) -> RewindError:
    if plan.exact and skipped:
        s = skipped[0]
        findings = list(s.findings) or [Finding(Problem.ABSENT, ".", s.reason)]
        if s.outcome is SkipOutcome.UNVERIFIABLE:
            return CheckpointUnverifiable(
                f"{plan.run} step {s.step} could not be checked right now: {s.reason}"
            )
        if s.outcome in (SkipOutcome.UNLOADABLE, SkipOutcome.MISMATCH):
            return UnloadableCheckpoint(f"{plan.run} step {s.step}", findings)
        return CorruptCheckpoint(f"{plan.run} step {s.step}", findings)
    detail = "; ".join(str(s) for s in skipped[:5])
    if any(s.outcome is SkipOutcome.UNVERIFIABLE for s in skipped):
        return CheckpointUnverifiable(
            f"run {plan.run!r} has checkpoints that could not be checked right now, refusing to go past them: "
            + detail,
            tuple(skipped),
        )
    if any(s.outcome is SkipOutcome.INCOMPLETE for s in skipped):  # a host's disk may come back
        return CheckpointUnverifiable(
            f"run {plan.run!r}: no checkpoint could be completed from the disks at hand (a host holding"
            " its files is gone, and no other tier holds a whole copy); refusing to start over: " + detail,
            tuple(skipped),
        )
    mismatched = [s for s in skipped if s.outcome is SkipOutcome.MISMATCH]
    if mismatched:  # a state object refused one: never start over on that (the job may have changed)
        return StateMismatch(
            f"of run {plan.run!r}: no checkpoint fits this job", list(mismatched[0].findings)
        )
    return NoRestorableCheckpoint(
        f"no checkpoint of run {plan.run!r} could be restored ({len(skipped)} tried)"
        + (f": {detail}" if detail else ""),
        tuple(skipped),
    )


@contextlib.contextmanager
def restoring(
    cat: Catalog,
    plan: RestorePlan,
    load: Loader[T],
    *,
    who: str | None = None,
    keyring: kr.Keyring | None = None,
    quick: bool = False,
    partial: bool = False,
    whole: Callable[[], bool] = lambda: True,
) -> Iterator[Restored[T]]:
    """Restore the first candidate that proves itself; its lease is held until the ``with`` block ends.

    ``quick``: ``load`` reads no bytes (a recovery hands the directory to a job that hashes every byte
    as it loads): a local copy is held to the catalog's manifest digest and its sizes only, and is not
    recorded as verified for it. ``partial``: ``load`` completes a local copy that holds one host's share
    of a checkpoint spread over hosts' disks (the sharded checkpointer); otherwise such a copy is passed
    over for the next. ``whole``: asked after a load, whether it read the local copy itself (False: it read
    files from a nearer copy, this node's memory, and the local copy is not recorded verified for it)."""
    ring = keyring if keyring is not None else kr.from_env()
    started = time.perf_counter()
    skipped: list[Skip] = []
    for cand in plan.candidates:
        try:
            lease = leases.take(cat, cand.checkpoint_id, who)
        except NotFoundError as exc:  # deleted (or rolled back) since the plan was made
            skipped.append(Skip(cand.step, cand.checkpoint_id, SkipOutcome.MISSING, str(exc)))
            if plan.exact:
                break
            continue
        try:
            got = _try(cat, plan, cand, load, ring, quick=quick, partial=partial, whole=whole)
        except BaseException:
            leases.release(cat, lease)
            raise
        if isinstance(got, Skip):
            leases.release(cat, lease)
            skipped.append(got)
            log.info("skipping %s", got)  # each failed copy was already warned about
            if plan.exact or got.outcome is SkipOutcome.UNVERIFIABLE:
                break  # never go past a checkpoint that may be good: that would throw its progress away
            continue
        for s in skipped:  # an older checkpoint loaded: the newer ones that did not were bad, not the job
            if s.outcome is SkipOutcome.MISMATCH:
                copies.condemn(cat, s.checkpoint_id, s.reason)
        opened, value, copy = got
        try:
            yield Restored(
                cand.checkpoint_id, cand.step, opened.directory, opened.manifest, copy.tier,
                opened.fetched, value, tuple(skipped), time.perf_counter() - started,
                copy.where() if opened.scratch else str(opened.directory),
            )  # fmt: skip
        finally:
            _drop(opened)
            leases.release(cat, lease)
        return
    raise _give_up(plan, skipped)


def execute(
    cat: Catalog,
    plan: RestorePlan,
    load: Loader[T],
    *,
    who: str | None = None,
    keyring: kr.Keyring | None = None,
    partial: bool = False,
    whole: Callable[[], bool] = lambda: True,
) -> Restored[T]:
    """:func:`restoring` for callers that are done with the checkpoint once ``load`` returned."""
    with restoring(cat, plan, load, who=who, keyring=keyring, partial=partial, whole=whole) as restored:
        return restored
