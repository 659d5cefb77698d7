"""Phase 3, replicate: copy checkpoints to another tier from a verified source, then apply retention.

``pending`` lists what the target lacks; ``replicate_checkpoint`` copies one checkpoint and
registers the copy only once the target proves it equal to the catalog's manifest
(``rewind.checkpoint.replicated``); ``apply_retention`` then deletes, on every tier, what
the policy no longer keeps. The target and the policy come from the caller or the
environment (``target_uri``, ``retention_policy``): the same for the flow and the CLI.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from rewind.infra import retention
from rewind.infra.catalog import copies, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import ConfigError
from rewind.infra.phases.notify import Notifier, run_event
from rewind.infra.replication import replicate
from rewind.infra.tiers import open_tier, transfer
from rewind.infra.tiers.base import Tier

MiB = 1 << 20
log = logging.getLogger("rewind.replicate")


@dataclass(frozen=True, slots=True)
class TierOptions:
    """How an S3 target is written (ignored for a filesystem target)."""

    part_size_mib: int = 64
    concurrency: int = 8
    immutable_days: int | None = None


@dataclass(frozen=True, slots=True)
class ReplicaMade:
    """One checkpoint's copy on the target, proven there."""

    run: str
    step: int
    checkpoint_id: int
    tier: str
    uri: str
    key: str
    bytes_sent: int
    bytes_reused: int
    already_there: bool
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "tier": self.tier,
            "uri": self.uri,
            "key": self.key,
            "bytes_sent": self.bytes_sent,
            "bytes_reused": self.bytes_reused,
        }


def target_uri(given: str | None) -> str:
    """The replication target: the caller's, else REWIND_OFFSITE_URI, else REWIND_SHARED_URI."""
    target = given or os.environ.get("REWIND_OFFSITE_URI") or os.environ.get("REWIND_SHARED_URI")
    if not target:
        raise ConfigError(
            "no replication target: pass one (s3://bucket/prefix, or a path) or set REWIND_OFFSITE_URI"
        )
    return target


def open_target(uri: str, options: TierOptions = TierOptions()) -> Tier:
    """The target tier, checked reachable and writable before anything is sent."""
    if uri.startswith("s3://"):
        tier = open_tier(
            uri,
            part_size=options.part_size_mib * MiB,
            concurrency=options.concurrency,
            immutable_days=options.immutable_days,
        )
    else:
        tier = open_tier(uri)
    tier.check()
    return tier


def retention_policy(keep_last: int | None = None, keep_every: int | None = None) -> retention.Policy | None:
    """The retention applied after replication: the caller's, else REWIND_KEEP_LAST / REWIND_KEEP_EVERY;
    None (nothing deleted) when neither names a number to keep."""
    last = keep_last or _env_int("REWIND_KEEP_LAST")
    if not last:
        return None
    every = keep_every or _env_int("REWIND_KEEP_EVERY") or 0
    return retention.Policy(keep_last=last, keep_every=every)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, not {raw!r}") from None


def pending(cat: Catalog, *, tier: Tier, run: str | None = None) -> list[int]:
    """Ids of restorable checkpoints (of ``run``, or every run) without a verified copy on ``tier`` that this
    machine can send (those lying only on other hosts' own disks are sent by those hosts)."""
    if run is not None:
        lineage.get_run(cat, run)  # an unknown run is an error, not "nothing to do"
    away = copies.sent_by_their_hosts(cat, tier.name, tier.uri, run)
    found = copies.without_copy(cat, tier.name, tier.uri, run)
    arrived = {ck.id for ck in found if ck.id in away and _arrived(cat, tier, ck)}  # to be registered
    if len(away) > len(arrived):
        log.info(
            "%d checkpoint(s) lie only on their hosts' own disks: those hosts send them",
            len(away) - len(arrived),
        )
    return [ck.id for ck in found if ck.id not in away or ck.id in arrived]


def _arrived(cat: Catalog, tier: Tier, ck: Any) -> bool:
    """Does the tier hold this checkpoint's manifest already (its hosts sent it; nobody registered it)?"""
    run = lineage.get_run_by_id(cat, ck.run_id).name
    digest = str(ck.manifest_digest)
    return any(transfer.holds(tier, key, digest) for key in transfer.candidate_keys(run, ck.step, digest))


def replicate_checkpoint(cat: Catalog, *, checkpoint_id: int, tier: Tier, notify: Notifier) -> ReplicaMade:
    """Copy one checkpoint to ``tier``; only a copy the tier proves equal to the manifest is registered."""
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    run = lineage.get_run_by_id(cat, ck.run_id).name
    started = time.monotonic()
    done = replicate(cat, ck, tier)
    made = ReplicaMade(
        run, ck.step, ck.id, tier.name, tier.uri, done.key, done.bytes_sent, done.bytes_reused,
        done.already_there, time.monotonic() - started,
    )  # fmt: skip
    notify.log(
        logging.INFO,
        "%s step %d replicated to %s/%s: %d bytes sent, %d reused from earlier copies there, in %.1fs%s",
        run, ck.step, tier.uri, done.key, done.bytes_sent, done.bytes_reused, made.seconds,
        " (already there, verified)" if done.already_there else "",
    )  # fmt: skip
    notify.event(
        run_event("rewind.checkpoint.replicated", run, made.as_dict(), step=ck.step, checkpoint_id=ck.id)
    )
    return made


def apply_retention(
    cat: Catalog, *, policy: retention.Policy, notify: Notifier, run: str | None = None
) -> dict[str, list[int]]:
    """Delete what ``policy`` no longer keeps, on every tier, each deletion re-checked; removed steps per run."""
    runs = [run] if run else [r["run"] for r in lineage.list_runs(cat)]
    removed = {name: retention.execute(cat, retention.plan(cat, name, policy), policy) for name in runs}
    for name, steps in removed.items():
        if steps:
            notify.log(
                logging.INFO,
                "retention on %s (keep_last %d): removed steps %s",
                name,
                policy.keep_last,
                steps,
            )
    return removed
