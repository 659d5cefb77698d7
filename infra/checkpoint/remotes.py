"""Rank 0's way to the files of a spread checkpoint that no disk at hand holds: another tier's copy.

A restore of a checkpoint spread over hosts' disks completes each disk's copy from the others
(``assemble``); a file whose host is gone is fetched from the checkpoint's copies on other tiers (the
shared tier first, as the restore plan orders them), each file held to the manifest entry that the
catalog's digest already proved. Only the files missing are fetched, never the whole copy.
"""

from __future__ import annotations

import logging

from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import manifest_matches
from rewind.infra.restore.plan import Copy, RestorePlan
from rewind.infra.tiers import fetch, open_tier, transfer
from rewind.infra.tiers.base import UNREADABLE_ERRORS, Tier

_FAILED: tuple[type[Exception], ...] = (CorruptCheckpoint, *UNREADABLE_ERRORS)
log = logging.getLogger("rewind.restore")


class RemoteFiles:
    """Single files of a checkpoint from its copies on other tiers, nearest first, each proven; it keeps
    count of the bytes it fetched from each tier."""

    def __init__(self, run: str, step: int, others: list[Copy]) -> None:
        self.run, self.step, self.others = run, step, others
        self.fetched: dict[str, int] = {}  # tier -> bytes
        self._opened: dict[str, Tier] = {}

    def __call__(self, entry: mf.FileEntry) -> bytes:
        errors = []
        for copy in self.others:
            key = copy.key or transfer.copy_key(self.run, self.step)
            try:
                tier = self._opened.get(copy.uri) or self._opened.setdefault(copy.uri, open_tier(copy.uri))
                data = fetch.fetch_file(tier, key, entry)
            except _FAILED as exc:
                errors.append(f"{copy.tier} copy at {copy.where()}: {exc}")
                continue
            self.fetched[copy.tier] = self.fetched.get(copy.tier, 0) + len(data)
            return data
        raise OSError(f"{entry.path} could not be fetched: {'; '.join(errors)}")


def files_of(p: RestorePlan, manifest: mf.Manifest, raw: bytes) -> RemoteFiles | None:
    """The fetcher of the other tiers' copies of the checkpoint whose manifest bytes are ``raw`` (proven
    against the catalog); None when it has none (or the plan cannot say: the restore goes on without)."""
    if not raw:
        return None
    try:
        cand = next(
            (c for c in p.candidates if c.step == manifest.step and manifest_matches(raw, c.manifest_digest)),
            None,
        )
    except Exception as exc:  # never fail rank 0 alone in the middle of a collective restore
        log.warning("no other tier's copy will be used for step %d: %s", manifest.step, exc)
        return None
    others = [c for c in cand.copies if not c.local] if cand is not None else []
    return RemoteFiles(cand.run, cand.step, others) if cand is not None and others else None
