"""Drill actions against off-site storage: the drill's own S3 service, cut or failed over mid-replication.

``start_s3`` runs one SeaweedFS server (``servers.SeaweedS3``), which ``replicate_through_outage`` stops
mid-copy and starts again; ``start_failover_s3`` runs an HA deployment (``failover_s3.FailoverS3``: two
metadata servers on one shared store behind one endpoint), whose primary ``replicate_through_failover``
kills mid-copy. Both point this process's AWS_* environment at the server (the job and the flows inherit
it); ``chaos.stop_servers`` stops them and puts the environment back. No Prefect here.
"""

from __future__ import annotations

import time
from typing import Any

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills import servers
from rewind.infra.drills.chaos import held_servers, set_env
from rewind.infra.drills.context import newest, run_of, state_dir
from rewind.infra.errors import ConfigError, NotFoundError, RewindError, TransientError

BUCKET = "rewind-drill"  # the bucket on the drill's own S3 server


def start_s3(configuration: dict[str, Any] | None = None) -> str:
    """Start the drill's own S3 server (SeaweedFS on loopback, in the drill's directory) with a bucket,
    and point this process's AWS_* environment at it (the job and the flows inherit it). Returns its URI."""
    held = held_servers(configuration)
    server = servers.SeaweedS3(state_dir(configuration) / "s3")
    server.start()
    held["s3"] = server
    server.client().create_bucket(Bucket=BUCKET)
    set_env(held, server.env)
    return f"s3://{BUCKET}/offsite"


def replicate_through_outage(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Replicate the run's newest checkpoint to the drill's S3 server and stop that server as soon as the
    first file is on it (replication's own per-file hook: mid-copy, before the manifest); then check that
    nothing was registered and no manifest landed, start the server again and replicate again, as the
    replicate task's retry does: it must send only what is missing and register one verified copy."""
    from rewind.infra.replication import replicate
    from rewind.infra.tiers import open_tier, transfer

    run, held = run_of(configuration), held_servers(configuration)
    server: servers.SeaweedS3 | None = held.get("s3")
    if server is None:
        raise ConfigError("the drill started no S3 server (start_s3 comes first)")
    ck = newest(run)
    if ck is None:
        raise NotFoundError(f"{run} has no checkpoint to replicate")
    cat, uri = Catalog(), f"s3://{BUCKET}/offsite"
    sent_before: list[str] = []

    def outage(path: str, sent: int) -> None:
        if not sent_before:
            sent_before.append(path)
            server.stop()  # graceful, as a service stop: SeaweedFS keeps what it acknowledged

    started = time.monotonic()
    try:
        # one file at a time: files in flight beside the first would land before the server stops
        replicate(cat, ck, open_tier(uri), on_file=outage, streams=1)
    except TransientError as exc:
        failed_with = str(exc)
    else:
        raise RewindError("the S3 server stopped mid-replication, yet the replication reported success")
    finally:
        if server.proc is None:
            server.start()
    offsite = [r for r in lineage.replicas_of(cat, ck.id) if r.tier == "offsite"]
    if offsite:
        raise RewindError(f"a copy was registered during the outage: {[(r.key, r.status) for r in offsite]}")
    key = transfer.copy_key(run, ck.step)
    if transfer.holds(open_tier(uri), key, str(ck.manifest_digest)) is not None:
        raise RewindError(f"a manifest landed at {uri}/{key} although the copy was cut short")
    done = replicate(cat, ck, open_tier(uri))
    _one_verified_offsite(cat, ck, uri, done.key)
    return {
        "step": ck.step, "stopped_after": sent_before[0] if sent_before else None, "failed_with": failed_with,
        "bytes_resent": done.bytes_sent, "bytes_total": ck.total_bytes, "key": done.key,
        "seconds": round(time.monotonic() - started, 3),
    }  # fmt: skip


def _one_verified_offsite(cat: Catalog, ck: Any, uri: str, key: str) -> None:
    """The copy at ``uri``/``key`` proves itself read back deep, and the catalog holds it as the one verified
    off-site copy of ``ck``."""
    from rewind.infra.catalog.models import ReplicaStatus
    from rewind.infra.format import keyring as kr
    from rewind.infra.format.verify import Verdict
    from rewind.infra.tiers import open_tier, transfer

    report = transfer.check_remote(
        open_tier(uri), key, str(ck.manifest_digest), deep=True, keyring=kr.from_env()
    )
    if report.verdict is not Verdict.VERIFIED:
        raise RewindError(f"the copy at {uri}/{key} does not prove itself: {report.findings}")
    registered = [(r.key, r.status) for r in lineage.replicas_of(cat, ck.id) if r.tier == "offsite"]
    if registered != [(key, ReplicaStatus.VERIFIED.value)]:
        raise RewindError(f"expected one verified off-site copy, the catalog has {registered}")


def start_failover_s3(configuration: dict[str, Any] | None = None) -> str:
    """Start the drill's own HA S3 service (``failover_s3.FailoverS3``: two SeaweedFS filers on one shared
    metadata store behind one endpoint) with a bucket, and point this process's AWS_* environment at its
    endpoint. Returns the bucket's URI."""
    from rewind.infra.drills.failover_s3 import FailoverS3

    held = held_servers(configuration)
    server = held["s3"] = FailoverS3(
        state_dir(configuration) / "s3-ha"
    )  # stopped by stop_servers, even half-started
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    set_env(held, server.env)
    return f"s3://{BUCKET}/offsite"


def replicate_through_failover(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Replicate the run's newest checkpoint to the drill's HA S3 service and SIGKILL its primary metadata
    server (filer A, with the S3 server in it) as soon as the first file is on it: the endpoint's front sends
    the rest to filer B, which shares A's metadata store. Whether the replication rode the failover out or
    failed and was replicated again (as the replicate task's retry does), it must end with one off-site copy,
    read back deep through B and registered verified once."""
    from rewind.infra.drills.failover_s3 import FailoverS3
    from rewind.infra.replication import replicate
    from rewind.infra.tiers import open_tier

    run, server = run_of(configuration), held_servers(configuration).get("s3")
    if not isinstance(server, FailoverS3):
        raise ConfigError("the drill started no HA S3 service (start_failover_s3 comes first)")
    ck = newest(run)
    if ck is None:
        raise NotFoundError(f"{run} has no checkpoint to replicate")
    cat, uri = Catalog(), f"s3://{BUCKET}/offsite"
    cut: dict[str, Any] = {}

    def failover(path: str, sent: int) -> None:
        if not cut:
            cut.update(after=path, failover_s=server.fail_over())

    started, failed_with, first = time.monotonic(), None, None
    try:  # one file at a time: the failover falls between two files' uploads
        first = replicate(cat, ck, open_tier(uri), on_file=failover, streams=1)
        done = first
    except TransientError as exc:
        failed_with = str(exc)
        done = replicate(cat, ck, open_tier(uri))
    if not cut:
        raise RewindError("the replication sent no file, so no failover happened")
    _one_verified_offsite(cat, ck, uri, done.key)
    return {
        "step": ck.step, "killed_after": cut["after"], "failover_s": cut["failover_s"],
        "failed_with": failed_with, "attempts": 1 if first is not None else 2,
        "bytes_resent": 0 if first is not None else done.bytes_sent, "bytes_total": ck.total_bytes,
        "key": done.key, "seconds": round(time.monotonic() - started, 3),
    }  # fmt: skip
