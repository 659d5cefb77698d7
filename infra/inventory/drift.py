"""Checking the catalog against storage, both ways, without changing either.

Three kinds of drift, each a typed finding: a copy the catalog believes in whose
files are gone (``row_without_files``), a copy on a tier that no catalog row
names (``files_without_row``), and a copy whose bytes are not the ones the
catalog recorded (``bytes_differ``). A copy that cannot be read right now is
``unreadable``: it says nothing about the bytes. Copies the catalog already
holds to be corrupt or missing are not drift: the catalog knows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from rewind.infra import config
from rewind.infra.catalog import copies, disks, locations
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, Replica
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import TransientError
from rewind.infra.format import keyring as kr
from rewind.infra.format import store
from rewind.infra.format.verify import Report, Verdict, check_copy
from rewind.infra.inventory.scan import LOCAL, open_for_scan, places, tier_kind
from rewind.infra.tiers import open_tier, transfer
from rewind.infra.tiers.base import TierAccessDenied, TierConfigError

KNOWN_BAD = (R.CORRUPT.value, R.MISSING.value)


class Drift(StrEnum):
    ROW_WITHOUT_FILES = "row_without_files"
    FILES_WITHOUT_ROW = "files_without_row"
    BYTES_DIFFER = "bytes_differ"
    UNREADABLE = "unreadable"


_BY_VERDICT = {
    Verdict.MISSING: Drift.ROW_WITHOUT_FILES,
    Verdict.CORRUPT: Drift.BYTES_DIFFER,
    Verdict.UNVERIFIABLE: Drift.UNREADABLE,
}


@dataclass(frozen=True, slots=True)
class DriftFinding:
    kind: Drift
    tier: str
    where: str
    run: str
    step: int | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "tier": self.tier,
            "where": self.where,
            "run": self.run,
            "step": self.step,
            "detail": self.detail,
        }


def _report(rep: Replica, ck: Checkpoint, run: str, deep: bool, ring: kr.Keyring) -> tuple[str, Report]:
    digest = str(ck.manifest_digest)
    if rep.tier == LOCAL:
        return rep.uri, check_copy(Path(rep.uri), digest, deep=deep, keyring=ring)
    key = locations.effective_key(rep, run, ck.step)
    return f"{rep.uri}/{key}", transfer.check_remote(open_tier(rep.uri), key, digest, deep=deep, keyring=ring)


def rows_against_storage(
    cat: Catalog, *, run: str | None, tiers: set[tuple[str, str]] | None, deep: bool, ring: kr.Keyring
) -> Iterator[DriftFinding]:
    """Each copy the catalog believes in (pending, verified, unverifiable), checked where it lies."""
    for rep, ck, name in copies.every_copy(cat, run):
        if rep.status in KNOWN_BAD or ck.manifest_digest is None or store.QUARANTINE in Path(rep.uri).parts:
            continue
        if rep.tier in disks.VOLATILE_TIERS:  # a memory copy: its node's agent keeps it, or it is gone
            continue
        if tiers is not None and not any(_on(rep, kind, uri) for kind, uri in tiers):
            continue
        if disks.elsewhere(rep.tier, rep.tier_id, rep.uri):  # another disk's to check
            continue
        try:
            where, report = _report(rep, ck, name, deep, ring)
        except (OSError, TransientError, TierAccessDenied, TierConfigError) as exc:
            yield DriftFinding(Drift.UNREADABLE, rep.tier, rep.uri, name, ck.step, str(exc)[:500])
            continue
        kind = _BY_VERDICT.get(report.verdict)
        if kind is not None:
            detail = "; ".join(str(f) for f in report.findings if f.fatal)[:500]
            yield DriftFinding(kind, rep.tier, where, name, ck.step, detail)


def _on(rep: Replica, kind: str, uri: str) -> bool:
    if rep.tier != kind:
        return False
    return Path(rep.uri).resolve().is_relative_to(Path(uri).resolve()) if kind == LOCAL else rep.uri == uri


def storage_against_rows(cat: Catalog, uri: str, kind: str, *, run: str | None) -> Iterator[DriftFinding]:
    """Each copy on the tier at ``uri`` that no catalog row names."""
    tier = open_for_scan(uri)
    named: set[str] = set()
    for rep, ck, name in copies.every_copy(cat, run):
        if rep.tier == kind == LOCAL:
            named.add(str(Path(rep.uri).resolve()))
        elif rep.tier == kind and rep.uri == tier.uri:
            named.add(locations.effective_key(rep, name, ck.step))
    for place in places(tier, run):
        seen = str((Path(tier.uri) / place.key).resolve()) if kind == LOCAL else place.key
        if seen not in named:
            where = f"{tier.uri}/{place.key}"
            yield DriftFinding(
                Drift.FILES_WITHOUT_ROW, kind, where, place.run, place.step, "no catalog row names this copy"
            )


def targets(cat: Catalog, uri: str | None, tier: str | None, run: str | None) -> list[tuple[str, str]]:
    """(tier kind, root URI) pairs to check: the one given, else the local root and every tier in use."""
    if uri is not None:
        return [(tier_kind(uri, tier), open_for_scan(uri, must_exist=not uri.startswith("s3://")).uri)]
    found = {(LOCAL, str(config.checkpoint_root()))}
    found |= {
        (r.tier, r.uri) for r, _, _ in copies.every_copy(cat, run) if r.tier not in disks.DIRECTORY_TIERS
    }
    for configured in (os.environ.get("REWIND_SHARED_URI"), os.environ.get("REWIND_OFFSITE_URI")):
        if configured:  # a tier with copies no row names yet (a catalog restored from an old backup)
            found.add((tier_kind(configured), open_for_scan(configured).uri))
    return sorted(found)


def check(
    cat: Catalog,
    uri: str | None = None,
    *,
    tier: str | None = None,
    run: str | None = None,
    deep: bool = False,
    rows: bool = True,
    keyring: kr.Keyring | None = None,
) -> list[DriftFinding]:
    """Every drift between the catalog and the tier at ``uri`` (default: every tier the catalog uses
    or is configured with, and every local copy wherever it lies). ``rows=False`` skips checking the
    catalog's copies where they lie (a scrub has just done that) and only looks for copies no row names."""
    ring = keyring if keyring is not None else kr.from_env()
    pairs = targets(cat, uri, tier, run)
    where = None if uri is None else set(pairs)
    found = list(rows_against_storage(cat, run=run, tiers=where, deep=deep, ring=ring)) if rows else []
    for kind, root in pairs:
        try:
            found += storage_against_rows(cat, root, kind, run=run)
        except (OSError, TransientError, TierAccessDenied, TierConfigError) as exc:
            found.append(DriftFinding(Drift.UNREADABLE, kind, root, run or "", None, str(exc)[:500]))
    return found
