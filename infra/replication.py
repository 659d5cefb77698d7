"""Replicating a checkpoint to another tier (a shared path, S3), nothing on trust.

The source is the nearest copy that proves itself against the catalog's manifest
digest (fetched into the local tier first if the local copy is gone), held by a
restore lease while it is sent. The target is asked what it already holds: a copy
whose manifest is the catalog's is complete and costs 0 bytes; a different
checkpoint under the same step (another timeline) is left alone and this one goes
under a name that cannot collide. Only a copy the target proves equal to the
manifest (sizes and server-side CRC32C) is registered, as verified.

Files an earlier verified copy of the run on the same tier already holds (the parent's
first, then the newest few) are copied there by the tier instead of sent
(:func:`transfer.push`), and held to the manifest exactly as an upload is.

A target whose disk refuses the write (full, read-only) stops the copy with one
``DiskWriteError`` naming it: nothing is registered, the source copy's status is left
as it was, and what was placed stays without a manifest (no checkpoint), for the
next run to keep what proves to be the manifest's and send the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rewind.infra import config
from rewind.infra.catalog import copies, lineage, locations
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import CorruptCheckpoint, RewindError
from rewind.infra.format import keyring as kr
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import manifest_matches
from rewind.infra.format.verify import Finding, Problem, Verdict, verify_files
from rewind.infra.restore import execute, plan
from rewind.infra.tiers import transfer
from rewind.infra.tiers.base import AlreadyExists, DiskWriteError, Tier

log = logging.getLogger("rewind.replicate")
REUSE_SOURCES = 3  # earlier copies whose manifests are read for files to copy instead of send


@dataclass(frozen=True, slots=True)
class Replicated:
    step: int
    key: str
    bytes_sent: int  # through this process, to the tier
    already_there: bool
    bytes_reused: int = 0  # copied on the tier from earlier copies of the run, nothing sent


def _register(cat: Catalog, ck: Checkpoint, tier: Tier, key: str) -> None:
    copies.add(cat, ck.id, tier.name, tier.uri, key=key, nbytes=ck.total_bytes or 0, status=R.VERIFIED)
    copies.settle(cat, ck.id)


def _send(
    cat: Catalog,
    ck: Checkpoint,
    run: str,
    tier: Tier,
    key: str,
    root: Path,
    on_file: Callable[[str, int], None] | None,
    streams: int,
) -> transfer.Pushed:
    digest = str(ck.manifest_digest)
    reuse = [
        transfer.Reuse(k, d) for k, d in copies.reuse_sources(cat, ck, tier.name, tier.uri, REUSE_SOURCES)
    ]
    p = plan.plan(cat, run, root=root, checkpoint_id=ck.id)
    with execute.restoring(cat, p, verify_files) as src:
        raw = (src.directory / mf.MANIFEST_NAME).read_bytes()
        if not manifest_matches(raw, digest):  # changed since it was verified a moment ago
            finding = Finding(Problem.MANIFEST, mf.MANIFEST_NAME, "changed while being replicated")
            raise CorruptCheckpoint(str(src.directory), [finding])
        try:
            return transfer.push(src.directory, raw, tier, key, reuse=reuse, on_file=on_file, streams=streams)
        except AlreadyExists:  # a manifest landed meanwhile (a concurrent run): fine only if it is ours
            if transfer.holds(tier, key, digest):
                return transfer.Pushed()
            raise
        except DiskWriteError as exc:  # the target's disk, not the copy being sent: nothing registered
            raise type(exc)(
                f"cannot replicate {run} step {ck.step}: {exc}; nothing is registered there, and the copy"
                f" at {src.directory} stays as it was"
            ) from exc


def replicate(
    cat: Catalog,
    ck: Checkpoint,
    tier: Tier,
    *,
    root: Path | None = None,
    on_file: Callable[[str, int], None] | None = None,
    streams: int = transfer.FILE_STREAMS,
) -> Replicated:
    """Copy one checkpoint to ``tier`` and register the verified copy (``streams`` files placed at once).

    Each candidate name is taken if it is free or holds this very checkpoint intact;
    one holding another timeline's checkpoint, or a damaged copy, is passed over, and so is a free one
    the catalog still lists for another checkpoint's copy (garbage collection may be deleting it: a copy
    already there, proven, is registered where it lies, e.g. one its hosts sent themselves).
    """
    run = lineage.get_run_by_id(cat, ck.run_id).name
    digest = str(ck.manifest_digest)
    passed: list[str] = []
    for key in transfer.candidate_keys(run, ck.step, digest):
        held = transfer.holds(tier, key, digest)
        if held is False:
            passed.append(f"{key} holds another checkpoint of step {ck.step} (another timeline)")
            continue
        if held:  # a tier without server checksums has its bytes read back before they count
            report = transfer.check_remote(tier, key, digest, deep=not tier.checksums, keyring=kr.from_env())
            if report.verdict is Verdict.VERIFIED and not report.deep and not tier.checksums:
                report = transfer.check_remote(
                    tier, key, digest, deep=True, keyring=kr.from_env()
                )  # none kept
            if report.verdict is Verdict.VERIFIED:
                _register(cat, ck, tier, key)
                return Replicated(ck.step, key, 0, True)
            passed.append(
                f"{key} holds a damaged copy ({'; '.join(str(f) for f in report.findings if f.fatal)})"
            )
            continue
        if locations.key_taken(
            cat, ck.id, tier.name, tier.uri, key
        ):  # no manifest, but gc may be reclaiming it
            passed.append(f"{key} is another checkpoint's copy in the catalog (reclaimed, or to be)")
            continue
        for why in passed:
            log.warning("%s: %s; this copy goes to %s", tier.uri, why, key)
        pushed = _send(cat, ck, run, tier, key, root or config.checkpoint_root(), on_file, streams)
        _register(cat, ck, tier, key)
        log.info(
            "replicated %s step %d to %s/%s (%d bytes sent, %d reused from earlier copies on the tier)",
            run,
            ck.step,
            tier.uri,
            key,
            pushed.sent,
            pushed.reused,
        )
        return Replicated(ck.step, key, pushed.sent, False, pushed.reused)
    raise RewindError(f"cannot replicate {run} step {ck.step} to {tier.uri}: " + "; ".join(passed))
