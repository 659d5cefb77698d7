"""Arguments newer than the rest of S3's API (a CRC32C, ``If-None-Match: *``), sent to a server until it refuses
them as unsupported; then the request is made again without the one it refused, and that one is not sent to
the endpoint again by this process (``S3Tier.refused``).

What stands in for each, where it was refused: for a checksum, ``Content-MD5`` on the request (checked by
every S3 server, and required by Object Lock buckets) and the object read back before it counts; for the
condition, a HEAD first (``AlreadyExists`` if the object is there), which a writer racing on the same key
can still pass: a read-back that finds other bytes then deletes the object only while its ETag is the one
the upload got (a writer replacing it between that HEAD and the delete can still lose it).
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from rewind.infra.tiers import s3_errors
from rewind.infra.tiers.base import AlreadyExists, ObjectNotFound, TierUnavailable

if TYPE_CHECKING:
    from rewind.infra.tiers.s3 import S3Tier

log = logging.getLogger("rewind.tiers")
CHECKSUM = "checksum"  # a PUT's x-amz-checksum-crc32c
FULL_OBJECT = "full-object"  # a multipart upload's CRC32C, its parts' and the whole's
IF_NONE_MATCH = "if-none-match"  # an upload's If-None-Match: *
CHECKSUM_MODE = "checksum-mode"  # a HEAD's x-amz-checksum-mode: ENABLED (to be shown the object's CRC32C)
CHECKSUMS = (CHECKSUM, FULL_OBJECT, CHECKSUM_MODE)

Instead = Callable[[], dict[str, Any]]


def md5_of(data: bytes) -> Instead:
    """``Content-MD5`` for ``data``: what a request without a CRC32C carries instead."""
    return lambda: {
        "ContentMD5": base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
    }


def _tries(sending: list[str]) -> Iterator[list[str]]:
    """The features to send on each try: all, then each one left out in turn (to learn which the server
    refuses), then none."""
    yield sending
    if len(sending) > 1:
        for left_out in sending:
            yield [f for f in sending if f != left_out]
    if sending:
        yield []


def call(
    tier: S3Tier,
    op: str,
    k: str,
    base: dict[str, Any],
    newer: dict[str, dict[str, Any]],
    *,
    creates: bool = False,
    instead: dict[str, Instead] | None = None,
) -> Any:
    """``op`` with ``base`` and each ``newer`` feature's arguments the server has not refused (``instead``:
    the arguments a feature not sent is replaced by). ``creates``: the call makes ``k``, which must not be
    there yet. Refused as unsupported, the call is made again with fewer of them; those the call that
    succeeded went without are recorded refused."""
    wanted = {**({IF_NONE_MATCH: {"IfNoneMatch": "*"}} if creates else {}), **newer}
    for sending in _tries([f for f in wanted if f not in tier.refused]):
        if creates and IF_NONE_MATCH not in sending:
            _absent(tier, k)
        args = dict(base)
        for feature in wanted:
            if feature in sending:
                args.update(wanted[feature])
            elif instead and feature in instead:
                args.update(instead[feature]())
        try:
            answer = getattr(tier._client, op)(Bucket=tier.bucket, **args)
        except ClientError as exc:
            if not s3_errors.unsupported(exc) or not sending:
                raise tier._error(exc, k) from exc
            continue
        except BotoCoreError as exc:
            raise tier._error(exc, k) from exc
        record_refused(tier, tuple(f for f in wanted if f not in sending and f not in tier.refused), op)
        return answer
    raise AssertionError("unreachable: the last try sends no newer argument")  # pragma: no cover


def record_refused(tier: S3Tier, features: tuple[str, ...], op: str) -> None:
    """``features`` not sent to this endpoint again by this process (said once, in a warning)."""
    if not features:
        return
    tier.refused.update(features)
    checksums = any(f in CHECKSUMS for f in features)
    log.warning(
        "%s refuses %s in %s as unsupported: not sent there again (%s)",
        tier.uri,
        ", ".join(features),
        op,
        "what is uploaded is read back to be verified" if checksums else "an object is looked for first",
    )
    if checksums:
        tier._keeps_no_checksums()


def _head(tier: S3Tier, k: str) -> dict[str, Any] | None:
    """The object's HEAD, or None where there is none."""
    try:
        return dict(tier._call("head_object", k, Key=k))
    except ObjectNotFound:
        return None


def _absent(tier: S3Tier, k: str) -> None:
    """``AlreadyExists`` if ``k`` is there: the check of a server that refused ``If-None-Match``."""
    if _head(tier, k) is not None:
        raise AlreadyExists(f"s3://{tier.bucket}/{k} already exists; replicas are never overwritten")


def ours(tier: S3Tier, k: str, answer: dict[str, Any]) -> bool:
    """Is the object at ``k`` still the one this upload's ``answer`` acknowledged (its ETag, quotes aside)?
    Always where the server honours ``If-None-Match`` (nothing else could have been written there), and
    where the object is gone; ``TierUnavailable`` where it cannot be told (no ETag, a HEAD that failed)."""
    if IF_NONE_MATCH not in tier.refused:
        return True
    sent = str(answer.get("ETag") or "").strip('"')
    if not sent:
        raise TierUnavailable(
            f"s3://{tier.bucket}/{k}: the server named no ETag; whose the object is is unknown"
        )
    head = _head(tier, k)
    return head is None or str(head.get("ETag") or "").strip('"') == sent
