"""Each host sends its own share of a committed checkpoint to the shared tier, in the background.

On hosts with node-local disks nothing but the host itself can read its files, so after a commit the
leader of every disk (the lowest rank writing to it) sends that disk's files to the shared tier
(``REWIND_SHARED_URI``): the files placed on its disk, and rank 0's leader also the files every disk
holds. Each file is held to its manifest entry as it lands (the server's CRC32C on S3, the bytes read back
on a filesystem; a leftover that does not prove to be the file is replaced). Then the leader writes its
disk's *mark* beside the copy (``.shares/<digest>-<disk>``): this disk's files are there, proven, for the
checkpoint whose manifest digest it names. A leader that then finds every disk's mark writes the manifest,
last, as the commit marker: files left by another timeline's unfinished push never count, since no mark
with this digest vouches for them. The tier lets one writer create the manifest; whoever has the catalog
(rank 0, or any rank a supervisor started) registers the copy once its manifest is there, waiting a
bounded while for the other hosts to complete it (the scheduled replication registers one completed later).

Which checkpoints go: the ranks decide together at each save (``decide``): one is sent only when every
host's sender is free, so every host sends the same checkpoints and none piles up behind a slow shared tier;
one committed while a host is still sending is not sent at all (the shared tier holds the newest checkpoint
every host could send). Training never waits for a push; a push that fails is logged, and the shared tier
holds no copy of that step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rewind.infra.catalog import copies, lineage, locations
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_bytes, manifest_digest, manifest_matches
from rewind.infra.tiers import open_tier, transfer
from rewind.infra.tiers.base import AlreadyExists, ObjectNotFound, Tier

log = logging.getLogger("rewind.share_push")
SHARED_ENV = "REWIND_SHARED_URI"
MARKS = ".shares"
ARRIVAL_S = 120.0  # how long a sender with the catalog waits for the other hosts to complete a copy


@dataclass(frozen=True, slots=True)
class Share:
    """One disk's part of a committed checkpoint, to be sent: its committed directory on this disk."""

    run: str
    step: int
    directory: Path
    disk: str  # this disk's id, as the manifest's placement names it
    with_common: bool  # also the files every disk holds (rank 0's disk sends those)
    avoid_step_key: bool = False  # the step's own key is another checkpoint's copy (``step_key_taken``)


@dataclass(frozen=True, slots=True)
class Pushed:
    """What one share's push did: the key on the tier, bytes sent, and whether the copy is complete there."""

    key: str
    sent: int
    complete: bool


def _key(tier: Tier, share: Share, digest: str) -> tuple[str, bool]:
    """Where this checkpoint's copy goes on the tier (another timeline's step is passed over), and whether
    its manifest is there already."""
    keys = transfer.candidate_keys(share.run, share.step, digest)
    for key in keys[1:] if share.avoid_step_key else keys:
        held = transfer.holds(tier, key, digest)
        if held is not False:
            return key, bool(held)
    raise OSError(f"the names for {share.run} step {share.step} on {tier.uri} hold other checkpoints")


def step_key_taken(cat: Catalog, checkpoint_id: int, run: str, step: int, tier: Tier) -> bool:
    """Whether the step's own key on ``tier`` is another checkpoint's copy in the catalog (a superseded
    step's, reclaimed or to be: its manifest may be gone while its files are still being deleted), so that
    every host sends this checkpoint to its other key (``locations.key_taken``). Asked by whoever has the
    catalog, for every host; True when the catalog cannot say. Never raises: every rank's collective
    decision follows."""
    try:
        return locations.key_taken(cat, checkpoint_id, tier.name, tier.uri, transfer.copy_key(run, step))
    except Exception as exc:  # CatalogUnavailable, a missing schema, a driver's error: the other key is safe
        log.warning("%s step %d: the catalog could not say whether %s is free: %s", run, step, tier.uri, exc)
        return True


def _mark(key: str, digest: str, disk: str) -> str:
    return f"{key}/{MARKS}/{digest[:32]}-{disk}"


def _marked(tier: Tier, key: str, digest: str, disks: set[str]) -> bool:
    """Has every disk in ``disks`` vouched for its files of this checkpoint?"""
    for disk in disks:
        try:
            tier.stat(_mark(key, digest, disk))
        except ObjectNotFound:
            return False
    return True


def _disks(manifest: mf.Manifest, own: str) -> set[str]:
    """The disks whose marks complete the copy: every disk a file is placed on, and the sender's own."""
    return {*manifest.placement.values(), own} if manifest.placement else {own}


def push(share: Share, tier: Tier, catalog: Catalog | None) -> Pushed:
    """Send ``share`` to ``tier`` and mark it; the manifest once every disk's mark is there."""
    raw = (share.directory / mf.MANIFEST_NAME).read_bytes()
    digest = manifest_digest(raw)
    manifest = mf.parse(raw)
    key, there = _key(tier, share, digest)
    sent = 0
    if not there:
        mine = [
            e
            for e in manifest.files
            if manifest.placement.get(e.path) == share.disk
            or (share.with_common and e.path not in manifest.placement)
        ]
        sent = transfer.push_files(share.directory, tier, key, mine)
        mark = digest.encode()
        with contextlib.suppress(AlreadyExists):  # this disk vouched for the same files before (run again)
            tier.put_bytes(_mark(key, digest, share.disk), mark, crc32c=hash_bytes(mark).crc32c)
        there = _marked(tier, key, digest, _disks(manifest, share.disk)) and _commit(tier, key, raw)
    if not there and catalog is not None:  # another host completes it: whoever has the catalog registers it
        there = _arrives(tier, key, digest)
    if there and catalog is not None:
        register(catalog, share.run, share.step, raw, tier, key)
    return Pushed(key, sent, there)


def _arrives(tier: Tier, key: str, digest: str, timeout_s: float = ARRIVAL_S) -> bool:
    """Wait (bounded) for the other hosts to complete the copy; True once its manifest is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        if transfer.holds(tier, key, digest) is True:
            return True
        if time.monotonic() > deadline:
            log.info(
                "%s: not complete %.0f s after this host's share (another host's still on its way)",
                key,
                timeout_s,
            )
            return False
        time.sleep(0.5)


def _commit(tier: Tier, key: str, raw: bytes) -> bool:
    """Write the manifest, last; True once it is this checkpoint's (written here, or a moment ago elsewhere)."""
    try:
        tier.put_bytes(f"{key}/{mf.MANIFEST_NAME}", raw, crc32c=hash_bytes(raw).crc32c)
    except AlreadyExists:
        return transfer.holds(tier, key, manifest_digest(raw)) is True
    return True


def register(cat: Catalog, run: str, step: int, raw: bytes, tier: Tier, key: str) -> None:
    """The copy at ``key``, complete on ``tier``, registered verified for its checkpoint (once)."""
    manifest = mf.parse(raw)
    for ck in lineage.checkpoints(cat, run, step=step):
        if not ck.manifest_digest or not manifest_matches(raw, ck.manifest_digest):
            continue
        known = [
            r for r in lineage.replicas_of(cat, ck.id) if (r.tier, r.uri, r.key) == (tier.name, tier.uri, key)
        ]
        if any(r.status == R.VERIFIED.value for r in known):
            continue
        copies.add(cat, ck.id, tier.name, tier.uri, key=key, nbytes=manifest.total_bytes, status=R.VERIFIED)
        copies.settle(cat, ck.id)


def decide(ready: bool, taken: bool = False, group: dist.ProcessGroup | None = None) -> tuple[bool, bool]:
    """Collective: whether to send this checkpoint (only if every rank's sender is free: ``ready``; a rank
    with none is), and whether every host avoids the step's own key (a rank with the catalog found it
    another checkpoint's: ``taken``)."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (ready, taken), group=group)
    return all(r for r, _ in every), any(t for _, t in every)


class SharePusher:
    """A rank's background sender: one push at a time; a share submitted while one waits replaces it."""

    def __init__(self, uri: str, catalog: Catalog | None) -> None:
        self.uri, self.catalog = uri, catalog
        self._tier: Tier | None = None  # opened once, for the catalog's question about its keys
        self._lock = threading.Condition()
        self._waiting: Share | None = None
        self._thread: threading.Thread | None = None  # None whenever no worker is running

    @classmethod
    def from_env(cls, catalog: Catalog | None) -> SharePusher | None:
        uri = os.environ.get(SHARED_ENV, "").strip()
        return cls(uri, catalog) if uri else None

    def step_key_taken(self, cat: Catalog, checkpoint_id: int, run: str, step: int) -> bool:
        """:func:`step_key_taken` on this sender's tier; True when the tier cannot be opened (the push says
        why). Never raises: every rank's collective decision follows."""
        try:
            if self._tier is None:
                self._tier = open_tier(self.uri)
        except Exception:  # the push opens it again and logs why it cannot
            return True
        return step_key_taken(cat, checkpoint_id, run, step, self._tier)

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._thread is None and self._waiting is None

    def submit(self, share: Share) -> None:
        with self._lock:
            if self._waiting is not None:
                log.info(
                    "%s step %d not sent: step %d replaces it", share.run, self._waiting.step, share.step
                )
            self._waiting = share
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="rewind-share-push", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                share, self._waiting = self._waiting, None
                if share is None:
                    self._thread = None  # under the lock: a submit from now on starts a new worker
                    self._lock.notify_all()
                    return
            self._send(share)

    def _send(self, share: Share) -> None:
        try:
            got = push(share, open_tier(self.uri), self.catalog)
            log.info(
                "%s step %d: this host's share sent to %s/%s (%d bytes)%s", share.run, share.step, self.uri,
                got.key, got.sent, "; the copy is complete there" if got.complete else "",
            )  # fmt: skip
        except Exception as exc:  # the job goes on; the shared tier holds no copy of this step
            log.warning(
                "%s step %d: this host's share not sent to %s: %s", share.run, share.step, self.uri, exc
            )

    def wait(self, timeout_s: float) -> bool:
        """Block until nothing is waiting or being sent (at most ``timeout_s``); False if still busy."""
        with self._lock:
            return self._lock.wait_for(
                lambda: self._thread is None and self._waiting is None, timeout=timeout_s
            )
