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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra import config
from infra.catalog import copies, lineage
from infra.catalog.db import Catalog
from infra.catalog.models import Checkpoint
from infra.catalog.models import ReplicaStatus as R
from infra.errors import CorruptCheckpoint, RewindError
from infra.format import keyring as kr
from infra.format import manifest as mf
from infra.format.digest import manifest_matches
from infra.format.verify import Finding, Problem, Verdict, verify_files
from infra.restore import execute, plan
from infra.tiers import transfer
from infra.tiers.base import AlreadyExists, Tier

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
            return transfer.push(src.directory, raw, tier, key, reuse=reuse, on_file=on_file)
        except AlreadyExists:  # a manifest landed meanwhile (a concurrent run): fine only if it is ours
            if transfer.holds(tier, key, digest):
                return transfer.Pushed()
            raise


def replicate(
    cat: Catalog,
    ck: Checkpoint,
    tier: Tier,
    *,
    root: Path | None = None,
    on_file: Callable[[str, int], None] | None = None,
) -> Replicated:
    """Copy one checkpoint to ``tier`` and register the verified copy.

    Each candidate name is taken if it is free or holds this very checkpoint intact;
    one holding another timeline's checkpoint, or a damaged copy, is passed over.
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
            if report.verdict is Verdict.VERIFIED:
                _register(cat, ck, tier, key)
                return Replicated(ck.step, key, 0, True)
            passed.append(
                f"{key} holds a damaged copy ({'; '.join(str(f) for f in report.findings if f.fatal)})"
            )
            continue
        for why in passed:
            log.warning("%s: %s; this copy goes to %s", tier.uri, why, key)
        pushed = _send(cat, ck, run, tier, key, root or config.checkpoint_root(), on_file)
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
