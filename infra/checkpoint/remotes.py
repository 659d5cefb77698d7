"""Rank 0's way to the files of a spread checkpoint that no disk at hand holds: another tier's copy.

A restore of a checkpoint spread over hosts' disks completes each disk's copy from the others
(``assemble``); a file whose host is gone is fetched from the checkpoint's copies on other tiers (the
shared tier first, as the restore plan orders them), each file held to the manifest entry that the
catalog's digest already proved. Only the files missing are fetched, never the whole copy.
"""

from __future__ import annotations

from rewind.infra.checkpoint.assemble import Remote
from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import manifest_matches
from rewind.infra.restore.plan import RestorePlan
from rewind.infra.tiers import fetch, open_tier, transfer
from rewind.infra.tiers.base import UNREADABLE_ERRORS, Tier

_FAILED: tuple[type[Exception], ...] = (CorruptCheckpoint, *UNREADABLE_ERRORS)


def files_of(p: RestorePlan, manifest: mf.Manifest, raw: bytes) -> Remote | None:
    """A fetcher of single files from the other tiers' copies of the checkpoint whose manifest bytes are
    ``raw`` (proven against the catalog), nearest first; None when it has no copy on another tier."""
    if not raw:
        return None
    cand = next(
        (c for c in p.candidates if c.step == manifest.step and manifest_matches(raw, c.manifest_digest)),
        None,
    )
    others = [c for c in cand.copies if not c.local] if cand is not None else []
    if cand is None or not others:
        return None
    opened: dict[str, Tier] = {}

    def one(entry: mf.FileEntry) -> bytes:
        errors = []
        for copy in others:
            key = copy.key or transfer.copy_key(cand.run, cand.step)
            try:
                tier = opened.setdefault(copy.uri, open_tier(copy.uri))
                return fetch.fetch_file(tier, key, entry)
            except _FAILED as exc:
                errors.append(f"{copy.tier} copy at {copy.where()}: {exc}")
        raise OSError(f"{entry.path} could not be fetched: {'; '.join(errors)}")

    return one
