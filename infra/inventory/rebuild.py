"""Rebuilding the catalog from the manifests on a tier: the last resort when the database is gone.

The manifests on the tiers are the ground truth of what was committed. A rebuild
reads every manifest it finds, checks the copy it heads (every byte by default),
and recreates runs, checkpoints with their files, parents, and this tier's copy
rows. What a copy proves is all it brings: a manifest that does not parse, is
misplaced, fails its signature, or heads files that do not match is reported and
not imported. With a key configured an unsigned manifest is refused as well:
without the catalog's digest, the signature is the only thing vouching for it.

Nothing on the tier can hold a rebuild up: what is not a regular file inside its
copy's directory (a FIFO, a device, a link leading out) is never opened, and a file
whose manifest claims more bytes than the tier can hold is never read; either
refuses that copy, in one line, and the rebuild goes on.

Running it again, or against a catalog that already knows some copies, adds only
what is missing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError

from rewind.infra import config
from rewind.infra.catalog import copies, disks, imported, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import RewindError, TransientError
from rewind.infra.format import files, store
from rewind.infra.format import keyring as kr
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import manifest_digest
from rewind.infra.format.verify import Report, check_copy
from rewind.infra.inventory.scan import LOCAL, Place, open_for_scan, places, tier_kind
from rewind.infra.tiers import transfer
from rewind.infra.tiers.base import Tier, TierAccessDenied


@dataclass(frozen=True, slots=True)
class Placed:
    run: str
    step: int
    key: str
    checkpoint_id: int
    action: str  # "new checkpoint" | "new copy" | "known copy"
    status: str  # the checkpoint's status afterwards


@dataclass(frozen=True, slots=True)
class Refused:
    key: str
    reason: str


@dataclass
class RebuildReport:
    tier: str
    uri: str
    deep: bool
    placed: list[Placed] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    unsigned: int = 0  # imported on the tier's word alone (no key configured)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read_manifest(tier: Tier, key: str) -> bytes:
    with tier.open(f"{key}/{mf.MANIFEST_NAME}") as f:
        return mf.read_bounded(f)


def _check(tier: Tier, kind: str, place: Place, digest: str, deep: bool, ring: kr.Keyring) -> Report:
    if kind == LOCAL:
        return check_copy(Path(tier.uri) / place.key, digest, deep=deep, keyring=ring)
    return transfer.check_remote(tier, place.key, digest, deep=deep, keyring=ring)


def _why_not(place: Place, raw: bytes, digest: str, report: Report, ring: kr.Keyring) -> str | None:
    """Why this copy must not be imported, or None."""
    if not report.ok or report.manifest is None:
        return "; ".join(str(f) for f in report.findings if f.fatal)[:500] or "did not verify"
    m = report.manifest
    if (m.run, m.step) != (place.run, place.step):
        return f"manifest says run {m.run!r} step {m.step}, but lies at {place.key}"
    if "." in place.key.rsplit("/", 1)[1] and not place.key.endswith(f".{digest[:16]}"):
        return "the name's digest suffix is not this manifest's digest"
    if ring.signing and mf.signature(raw, ring) is kr.Signature.UNSIGNED:
        return "unsigned, and a key is configured: only signed manifests are imported without a catalog"
    return None


def _place(
    cat: Catalog, kind: str, tier: Tier, place: Place, m: mf.Manifest, digest: str, deep: bool
) -> tuple[Placed, bool]:
    """Record one proven copy; returns what was done and whether a checkpoint was created for it.

    A copy row the catalog already has is left as it is unless this check proved it byte for
    byte: a quick look must not undo what a scrub found.
    """
    run_id = lineage.ensure_run(cat, m.run)
    local_dir = Path(tier.uri) / place.key
    uri, key = (str(local_dir), None) if kind == LOCAL else (tier.uri, place.key)
    status = R.VERIFIED if deep else R.PENDING
    ck = imported.by_digest(cat, run_id, digest)
    if ck is None:
        path = str(local_dir if kind == LOCAL else config.checkpoint_root() / m.run / f"step-{m.step}")
        adopted = kept_by_its_tool(m)  # its pin comes back with it
        copy = imported.FirstCopy(kind, uri, key, status)
        ck_id = imported.insert(cat, run_id, m, digest=digest, path=path, copy=copy, pinned=adopted)
        return Placed(m.run, m.step, place.key, ck_id, "new checkpoint", ""), True
    known = any(
        disks.same_copy(r, kind, uri) and r.status != R.DELETED.value
        for r in copies.copies_of(cat, [ck.id])[ck.id]
    )
    if not known or deep:
        copies.add(cat, ck.id, kind, uri, key=key, nbytes=m.total_bytes, status=status)
        copies.settle(cat, ck.id)
    return Placed(m.run, m.step, place.key, ck.id, "known copy" if known else "new copy", ""), False


@dataclass
class _Lineage:
    """What the pass after the imports needs: each placed checkpoint's parent, and which were adopted."""

    parents: dict[int, dict[int, tuple[int | None, str | None]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    adopted: set[int] = field(default_factory=set)

    def note(self, run_id: int, ck_id: int, m: mf.Manifest) -> None:
        self.parents[run_id][ck_id] = (m.parent_step, m.parent_digest)  # a parent may come later
        if kept_by_its_tool(m):
            self.adopted.add(ck_id)

    def settle(self, cat: Catalog) -> None:
        for run_id, of_run in self.parents.items():
            imported.link_parents(cat, run_id, of_run)
            imported.retire_abandoned(cat, run_id, list(of_run), exempt=self.adopted)


def kept_by_its_tool(m: mf.Manifest) -> bool:
    """Adopted and still the other tool's (pinned, outside the run's timeline), not taken over by Rewind."""
    return str(m.writer.get("engine", "")).startswith("adopted:") and m.writer.get("owner") != store.OWNER


def _one(
    cat: Catalog, kind: str, tier: Tier, place: Place, deep: bool, ring: kr.Keyring
) -> tuple[Placed, mf.Manifest] | Refused:
    """Check and import the copy at one place, or say why not; never raises for what the copy holds."""
    try:
        raw = _read_manifest(tier, place.key)
        digest = manifest_digest(raw)
        checked = _check(tier, kind, place, digest, deep, ring)
    except files.NotAFile as exc:  # its manifest.json: a link out of the copy, or swapped for a FIFO
        return Refused(place.key, f"damaged: {exc}")
    except (OSError, TransientError, TierAccessDenied, mf.ManifestError) as exc:
        return Refused(place.key, f"unreadable: {exc}")
    why = _why_not(place, raw, digest, checked, ring)
    if why is not None or checked.manifest is None:
        return Refused(place.key, why or "did not verify")
    try:
        placed, _ = _place(cat, kind, tier, place, checked.manifest, digest, deep)
    except TransientError:
        raise  # the catalog or the tier is unreachable: not this copy's fault
    except (RewindError, OverflowError, DBAPIError) as exc:
        return Refused(place.key, f"not placed: {str(exc).splitlines()[0][:300]}")
    return placed, checked.manifest


def rebuild(
    cat: Catalog,
    uri: str,
    *,
    tier: str | None = None,
    run: str | None = None,
    deep: bool = True,
    keyring: kr.Keyring | None = None,
) -> RebuildReport:
    """Import every copy on the tier at ``uri`` that proves itself; report the others and why."""
    ring = keyring if keyring is not None else kr.from_env()
    if run is not None:
        lineage.check_run_name(run)
    kind = tier_kind(uri, tier)
    source = open_for_scan(uri, must_exist=True)
    report = RebuildReport(kind, source.uri, deep)
    found = _Lineage()
    try:
        for place in places(source, run):
            got = _one(cat, kind, source, place, deep, ring)
            if isinstance(got, Refused):
                report.refused.append(got)
                continue
            placed, m = got
            report.placed.append(placed)
            report.unsigned += int(not ring.signing)
            found.note(lineage.get_run(cat, m.run).id, placed.checkpoint_id, m)
    finally:  # what was imported gets its lineage even when the scan stopped half-way
        found.settle(cat)
    now = {c.id: str(c.status) for p in report.placed for c in [lineage.get_checkpoint(cat, p.checkpoint_id)]}
    report.placed = [replace(p, status=now[p.checkpoint_id]) for p in report.placed]
    return report
