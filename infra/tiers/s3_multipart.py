"""A large file up to S3 as a resumable multipart upload, driven here rather than by boto3's transfer manager:
a re-run lists the parts the server already holds and sends only the missing ones.

Each part carries its CRC32C and the whole a full-object CRC32C, unless the server refused those as
unsupported (``S3Tier.refused``): then the parts go up bare and the object is read back to be verified.
An unfinished upload begun bare that the server will not go on with checksums (AWS refuses them at the
next part, or at the completion) is aborted and the file sent afresh.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rewind.infra import progress
from rewind.infra.errors import RewindError, is_transient
from rewind.infra.format import digest
from rewind.infra.tiers import s3_newer
from rewind.infra.tiers.base import (
    AlreadyExists,
    ChecksumModeMismatch,
    CompletionRefused,
    DigestRefused,
    ObjectNotFound,
    TierUnavailable,
    UploadGone,
)
from rewind.infra.tiers.s3_newer import FULL_OBJECT

if TYPE_CHECKING:
    from rewind.infra.tiers.s3 import S3Tier

log = logging.getLogger("rewind.tiers")
MiB = 1 << 20
MAX_PARTS = 10_000  # the most parts one multipart upload may have (S3 and every server that copies it)


def part_size(size: int, least: int) -> int:
    """The part size of a ``size``-byte upload: ``least``, or larger (whole MiB) so it has at most
    ``MAX_PARTS`` parts; the same for every try of one file, so a resumed upload keeps its parts."""
    fewest = -(-size // MAX_PARTS)
    return max(least, -(-fewest // MiB) * MiB)


def _same_part(held: dict[str, Any], data: bytes, crc: str) -> bool:
    """Is a part the server already holds the one we would send? Its CRC32C if listed, else its ETag (MD5)."""
    if held.get("ChecksumCRC32C"):
        return bool(held["ChecksumCRC32C"] == crc)
    return str(held.get("ETag", "")).strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest()


def uploads(tier: S3Tier, full: str) -> tuple[dict[str, Any], ...]:
    """Every unfinished multipart upload whose key starts with ``full``, over every page of the listing."""
    found: list[dict[str, Any]] = []
    marker: dict[str, str] = {}
    while True:
        page = tier._call("list_multipart_uploads", full, Prefix=full, **marker)
        found += page.get("Uploads", [])
        if not page.get("IsTruncated"):
            return tuple(found)
        marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def _pending(tier: S3Tier, k: str) -> str | None:
    """The newest upload of ``k`` left unfinished (a push cut short) that can be resumed in this tier's mode
    (``_same_mode``), over every page of the listing."""
    bare = FULL_OBJECT in tier.refused
    ups = [u for u in uploads(tier, k) if u["Key"] == k and _same_mode(u.get("ChecksumAlgorithm"), bare=bare)]
    return max(ups, key=lambda u: u["Initiated"])["UploadId"] if ups else None


def _same_mode(listed: str | None, *, bare: bool) -> bool:
    """Whether an upload listed with checksum algorithm ``listed`` may be resumed: bare, one listed without;
    with checksums, one listed with CRC32C, or without (a server that does not say; one begun bare is then
    refused at its next part or completion, and aborted)."""
    return not listed if bare else (listed or "CRC32C").upper() == "CRC32C"


def _parts_held(tier: S3Tier, k: str, upload_id: str) -> dict[int, dict[str, Any]]:
    held: dict[int, dict[str, Any]] = {}
    marker: dict[str, int] = {}
    while True:
        page = tier._call("list_parts", k, Key=k, UploadId=upload_id, **marker)
        for p in page.get("Parts", []):
            held[int(p["PartNumber"])] = p
        if not page.get("IsTruncated"):
            return held
        marker = {"PartNumberMarker": int(page["NextPartNumberMarker"])}


def _start(tier: S3Tier, k: str) -> str:
    checksum = {"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"}
    base = {"Key": k, **tier._lock()}
    answer = s3_newer.call(tier, "create_multipart_upload", k, base, {FULL_OBJECT: checksum})
    return str(answer["UploadId"])


def upload(tier: S3Tier, key: str, src: Path, size: int, crc_full: str) -> int:
    """``src`` to ``key`` in parts, those the server holds of an unfinished upload kept; bytes sent. An
    unfinished upload whose parts will not make this file as asked (begun by a process that sent no
    checksums, where this one does; or its completion refused as not adding up to it) is aborted and the file sent afresh,
    never left to fail every push; an upload that went meanwhile (another sender of the copy completed or
    aborted it) is not an error either."""
    k = tier._key(key)
    upload_id = _pending(tier, k)
    if upload_id is not None:
        try:
            return _send(tier, key, src, size, crc_full, upload_id, _parts_held(tier, k, upload_id))
        except (ChecksumModeMismatch, CompletionRefused) as exc:
            _abort(tier, key, upload_id, exc)
        except UploadGone:
            _not_there_yet(tier, key)
    try:
        return _afresh(tier, key, src, size, crc_full)
    except UploadGone:  # resumed by another sender, who completed or aborted it; or a completion retried
        _not_there_yet(tier, key)
        raise TierUnavailable(f"s3://{tier.bucket}/{k}: the upload went before it was completed") from None


def _afresh(tier: S3Tier, key: str, src: Path, size: int, crc_full: str) -> int:
    """``src`` sent in a new upload; where the server will not complete it as the whole file's CRC32C names,
    though it took each part with its own, it keeps no full-object checksum (MinIO before 2025 keeps one
    of its parts' checksums, whatever was asked): that upload is aborted and the file sent bare, as to a
    server that refuses checksums, and read back."""
    k = tier._key(key)
    bare = (
        FULL_OBJECT in tier.refused
    )  # as this upload is begun (another file's may learn otherwise meanwhile)
    upload_id = _start(tier, k)
    try:
        return _send(tier, key, src, size, crc_full, upload_id, {})
    except WholeRefused as exc:
        if bare:  # refused without the whole's checksum: not that; the task retries
            raise
        _abort(tier, key, upload_id, exc)  # first: an upload begun with checksums never left behind unsaid
        if FULL_OBJECT not in tier.refused:
            s3_newer.record_refused(tier, (FULL_OBJECT,), "complete_multipart_upload")
    return _send(tier, key, src, size, crc_full, _start(tier, k), {})


class WholeRefused(CompletionRefused):
    """A completion refused though its parts, each taken with its CRC32C, add up to the whole file's: the
    server does not hold the whole to the CRC32C asked for (not the parts' fault)."""


def _whole(parts: list[dict[str, Any]], step: int, size: int) -> str:
    """The CRC32C of the file the parts make, from theirs (in part order, each ``step`` bytes but the last)."""
    crc = 0
    for p in sorted(parts, key=lambda p: int(p["PartNumber"])):
        length = min(step, size - (int(p["PartNumber"]) - 1) * step)
        part = int.from_bytes(base64.b64decode(p["ChecksumCRC32C"]), "big")
        crc = digest.crc32c_combine(crc, part, length)
    return digest.crc32c_b64(crc)


def _not_there_yet(tier: S3Tier, key: str) -> None:
    """``AlreadyExists`` where the object is there (a sender completed the upload: the caller holds it to its
    file as any object found in place); otherwise returns, to send the file afresh."""
    try:
        tier.stat(key)
    except ObjectNotFound:
        log.info(
            "s3://%s/%s: the unfinished upload went meanwhile; the file is sent afresh",
            tier.bucket,
            tier._key(key),
        )
        return
    raise AlreadyExists(f"s3://{tier.bucket}/{tier._key(key)} was completed meanwhile by another sender")


def _abort(tier: S3Tier, key: str, upload_id: str, why: ChecksumModeMismatch | CompletionRefused) -> None:
    """The unfinished upload whose parts will not make the file let go, so the file can be sent afresh; where
    it cannot be, the abort's error if retrying may help, otherwise ``why`` (the abort's error logged)."""
    k = tier._key(key)
    try:
        tier._call("abort_multipart_upload", k, Key=k, UploadId=upload_id)
    except UploadGone:
        _not_there_yet(tier, key)  # gone meanwhile: completed by another sender, or sent afresh
        return
    except RewindError as err:
        if is_transient(err):
            raise
        log.warning("s3://%s/%s: the unfinished upload was not aborted: %s", tier.bucket, k, err)
        raise why from err
    log.warning("%s; that unfinished upload was aborted and the file is sent afresh", why)


def _send(
    tier: S3Tier,
    key: str,
    src: Path,
    size: int,
    crc_full: str,
    upload_id: str,
    held: dict[int, dict[str, Any]],
) -> int:
    """The parts ``held`` lacks sent to ``upload_id``, then the whole completed and vouched for; bytes sent."""
    k = tier._key(key)
    step = part_size(size, tier.part_size)
    count = (size + step - 1) // step
    fd = os.open(src, os.O_RDONLY)
    meter = progress.current()  # the part threads report to this context's watcher

    def part(n: int) -> tuple[dict[str, Any], int]:
        done = send(n)
        if meter is not None:
            meter.advance(min(step, size - (n - 1) * step))
        return done

    def send(n: int) -> tuple[dict[str, Any], int]:
        offset = (n - 1) * step
        data = os.pread(fd, min(step, size - offset), offset)
        crc = digest.crc32c_b64(digest.crc32c(data))
        have = held.get(n)
        if have and int(have["Size"]) == len(data) and _same_part(have, data, crc):
            return {"PartNumber": n, "ETag": have["ETag"], "ChecksumCRC32C": crc}, 0
        base = {"Key": k, "UploadId": upload_id, "PartNumber": n, "Body": data, "ContentLength": len(data)}
        newer, instead = {FULL_OBJECT: {"ChecksumCRC32C": crc}}, {FULL_OBJECT: s3_newer.md5_of(data)}
        r = s3_newer.call(tier, "upload_part", k, base, newer, instead=instead)
        return {"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32C": crc}, len(data)

    try:
        with ThreadPoolExecutor(tier.concurrency, thread_name_prefix="s3-part") as pool:
            done = list(pool.map(part, range(1, count + 1)))
    finally:
        os.close(fd)
    parts = [p for p, _ in done]
    try:
        answer = _complete(tier, k, upload_id, parts, crc_full)
    except DigestRefused as exc:  # the parts held do not add up to this file, or the server will not check
        if _whole(parts, step, size) == crc_full:
            raise WholeRefused(str(exc)) from exc
        raise CompletionRefused(str(exc)) from exc
    tier._vouched(key, answer, crc_full, size)
    return sum(n for _, n in done)


def _complete(tier: S3Tier, k: str, upload_id: str, parts: list[dict[str, Any]], crc_full: str) -> Any:
    """Complete the upload; where the server refuses checksums, with the parts listed bare."""
    bare = [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]} for p in parts]
    base = {"Key": k, "UploadId": upload_id, "MultipartUpload": {"Parts": bare}}
    full = {"MultipartUpload": {"Parts": parts}, "ChecksumCRC32C": crc_full, "ChecksumType": "FULL_OBJECT"}
    return s3_newer.call(tier, "complete_multipart_upload", k, base, {FULL_OBJECT: full}, creates=True)
