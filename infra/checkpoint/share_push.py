"""Each host sends its own share of a committed checkpoint to the shared tier, in the background.

On hosts with node-local disks nothing but the host itself can read its files, so after a commit the
leader of every disk (the lowest rank writing to it) sends that disk's files to the shared tier
(``REWIND_SHARED_URI``): the files placed on its disk, and rank 0's leader also the files every disk
holds. Each file is held to its manifest entry as it lands (the server's CRC32C on S3, the bytes read back
on a filesystem). A leader that finds, after its own files, every file of the manifest on the tier
writes the manifest there, last, as the commit marker; the tier lets exactly one writer create it, and
that one registers the copy as verified (rank 0, or any rank started by a supervisor, which reaches the
catalog; otherwise the next scheduled replication finds it there and registers it). Training never waits
for this: one push at a time per rank, a newer checkpoint replacing one not yet started; a push that fails
is logged, and the shared tier simply holds no copy of that step.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from rewind.infra.catalog import copies, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_bytes, manifest_digest, manifest_matches
from rewind.infra.tiers import open_tier, transfer
from rewind.infra.tiers.base import AlreadyExists, Tier

log = logging.getLogger("rewind.share_push")
SHARED_ENV = "REWIND_SHARED_URI"


@dataclass(frozen=True, slots=True)
class Share:
    """One disk's part of a committed checkpoint, to be sent: its committed directory on this disk."""

    run: str
    step: int
    directory: Path
    disk: str  # this disk's id, as the manifest's placement names it
    with_common: bool  # also the files every disk holds (rank 0's disk sends those)


@dataclass(frozen=True, slots=True)
class Pushed:
    """What one share's push did: the key on the tier, bytes sent, and whether this push committed the copy."""

    key: str
    sent: int
    committed: bool


def _key(tier: Tier, run: str, step: int, digest: str) -> str | None:
    """Where this checkpoint's copy goes on the tier (another timeline's step is passed over); None when a
    copy of it is there already."""
    for key in transfer.candidate_keys(run, step, digest):
        held = transfer.holds(tier, key, digest)
        if held is None:
            return key
        if held:
            return None
    raise OSError(f"both names for {run} step {step} on {tier.uri} hold other checkpoints")


def push(share: Share, tier: Tier, catalog: Catalog | None) -> Pushed | None:
    """Send ``share`` to ``tier``; write the manifest when the tier then holds every file. None: already there."""
    raw = (share.directory / mf.MANIFEST_NAME).read_bytes()
    digest = manifest_digest(raw)
    manifest = mf.parse(raw)
    key = _key(tier, share.run, share.step, digest)
    if key is None:
        return None
    mine = [
        e
        for e in manifest.files
        if manifest.placement.get(e.path) == share.disk
        or (share.with_common and e.path not in manifest.placement)
    ]
    sent = transfer.push_files(share.directory, tier, key, mine)
    if not transfer.holds_files(tier, key, manifest):
        return Pushed(key, sent, False)  # another host's files are still on their way: its push ends it
    try:
        tier.put_bytes(f"{key}/{mf.MANIFEST_NAME}", raw, crc32c=hash_bytes(raw).crc32c)
    except AlreadyExists:
        return Pushed(key, sent, False)  # another host wrote it a moment ago: it registers the copy
    if catalog is not None:
        _register(catalog, share, raw, manifest, tier, key)
    return Pushed(key, sent, True)


def _register(cat: Catalog, share: Share, raw: bytes, manifest: mf.Manifest, tier: Tier, key: str) -> None:
    found = [
        c
        for c in lineage.checkpoints(cat, share.run, step=share.step)
        if c.manifest_digest and manifest_matches(raw, c.manifest_digest)
    ]
    for ck in found:
        copies.add(cat, ck.id, tier.name, tier.uri, key=key, nbytes=manifest.total_bytes, status=R.VERIFIED)
        copies.settle(cat, ck.id)


class SharePusher:
    """A rank's background sender: one push at a time, the newest share waiting replaces an older one."""

    def __init__(self, uri: str, catalog: Catalog | None) -> None:
        self.uri, self.catalog = uri, catalog
        self._lock = threading.Condition()
        self._waiting: Share | None = None
        self._busy = False
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, catalog: Catalog | None) -> SharePusher | None:
        uri = os.environ.get(SHARED_ENV, "").strip()
        return cls(uri, catalog) if uri else None

    def submit(self, share: Share) -> None:
        with self._lock:
            if self._waiting is not None:
                log.info(
                    "%s step %d not sent to %s: step %d replaces it",
                    share.run,
                    self._waiting.step,
                    self.uri,
                    share.step,
                )
            self._waiting = share
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="rewind-share-push", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def _work(self) -> None:
        while True:
            with self._lock:
                share, self._waiting = self._waiting, None
                self._busy = share is not None
                self._lock.notify_all()
                if share is None:
                    return
            try:
                got = push(share, open_tier(self.uri), self.catalog)
                if got is not None:
                    log.info(
                        "%s step %d: this host's share sent to %s/%s (%d bytes)%s", share.run, share.step,
                        self.uri, got.key, got.sent, "; the copy is complete there" if got.committed else "",
                    )  # fmt: skip
            except Exception as exc:  # the job goes on; the shared tier holds no copy of this step
                log.warning(
                    "%s step %d: this host's share not sent to %s: %s", share.run, share.step, self.uri, exc
                )
            with self._lock:
                self._busy = False
                self._lock.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Block until nothing is waiting or being sent (at most ``timeout_s``); False if still busy."""
        with self._lock:
            return self._lock.wait_for(lambda: self._waiting is None and not self._busy, timeout=timeout_s)
