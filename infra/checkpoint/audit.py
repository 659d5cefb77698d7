"""Verifying recorded checkpoints and writing the verdict to the catalog."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import Checkpoint, CheckpointStatus
from infra.checkpoint import manifest as mf
from infra.checkpoint.verify import Finding, Problem, Report, verify_directory
from infra.digest import hash_bytes

log = logging.getLogger("rewind.verify")
S = CheckpointStatus


def manifest_matches_catalog(directory: Path, ck: Checkpoint) -> Finding | None:
    """A manifest swapped or edited after commit no longer hashes to the recorded digest."""
    if ck.manifest_digest is None:
        return None
    try:
        raw = (directory / mf.MANIFEST_NAME).read_bytes()
    except OSError:
        return None  # reported by the directory check
    got = hash_bytes(raw).xxh3
    if got != ck.manifest_digest:
        return Finding(
            Problem.MANIFEST,
            mf.MANIFEST_NAME,
            f"digest {got} differs from the catalog's {ck.manifest_digest}",
        )
    return None


def record_corrupt(cat: Catalog, ck: Checkpoint, findings: list[Finding]) -> None:
    reason = "; ".join(str(f) for f in findings if f.fatal)
    if lineage.transition(cat, ck.id, (S.COMMITTED, S.VERIFIED), S.CORRUPT, reason):
        log.error("checkpoint %s step %d marked corrupt: %s", ck.path, ck.step, reason)


def verify_recorded(cat: Catalog, ck: Checkpoint, *, deep: bool) -> Report:
    """Check one catalogued checkpoint; a deep pass promotes it to verified, any failure marks it corrupt."""
    directory = Path(ck.path)
    report = verify_directory(directory, deep=deep)
    extra = manifest_matches_catalog(directory, ck)
    if extra is not None:
        report = replace(report, findings=(*report.findings, extra))
    if report.manifest is not None and report.manifest.step != ck.step:
        wrong = Finding(
            Problem.MANIFEST, mf.MANIFEST_NAME, f"names step {report.manifest.step}, catalog says {ck.step}"
        )
        report = replace(report, findings=(*report.findings, wrong))
    if not report.ok:
        record_corrupt(cat, ck, list(report.findings))
    elif deep:
        lineage.transition(cat, ck.id, (S.COMMITTED, S.VERIFIED), S.VERIFIED)
    return report
