"""S3-compatible object storage (AWS S3, MinIO, Ceph RGW, SeaweedFS, R2) through boto3.

Credentials and endpoint come from the standard AWS environment and config
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``,
``AWS_ENDPOINT_URL``). Every upload carries a CRC32C the server checks
(``BadDigest`` otherwise) and ``IfNoneMatch='*'`` so nothing is overwritten; a
server that refuses either as unsupported is asked again without it (``s3_newer``),
and what it then holds is read back to be verified, or looked for first.

Large files go up as resumable multipart uploads (``s3_multipart``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import boto3
import botocore
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

from rewind.infra import progress, redact
from rewind.infra.format import digest
from rewind.infra.tiers import s3_errors, s3_multipart, s3_newer
from rewind.infra.tiers.base import (
    AlreadyExists,
    NotCopied,
    ObjectInfo,
    ObjectNotFound,
    TierConfigError,
    TierUnavailable,
)
from rewind.infra.tiers.s3_ranged import RangedBody

log = logging.getLogger("rewind.tiers")
MiB, GiB = 1 << 20, 1 << 30
MAX_COPY = 5 << 30  # the largest object one CopyObject request may copy
RANGE_TRIES = 4  # tries of one range of a large object's download (a body cut short is asked for again)
RANGE_BACKOFF_S = 0.2  # before the second try; doubled before each next
_REFUSED: dict[str, set[str]] = {}  # endpoint -> the features it refused (``S3Tier.refused``)
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # loose: other servers allow '_' and capitals


def parse_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at the ends)."""
    if not uri.startswith("s3://"):
        raise TierConfigError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise TierConfigError(f"S3 URI {uri!r} names no bucket")
    if not _BUCKET.fullmatch(bucket):
        raise TierConfigError(
            f"S3 URI {uri!r}: {bucket!r} is not a bucket name (letters, digits, '.', '-', '_')"
        )
    return bucket, prefix.strip("/")


def _client(concurrency: int) -> Any:
    """An S3 client from the standard AWS environment; an endpoint that is no URL is bad input, said in one line."""
    try:
        return boto3.session.Session().client(
            "s3",
            config=Config(
                retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=5,
                read_timeout=120,
                max_pool_connections=concurrency + 4,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
    except ValueError as exc:  # botocore: "Invalid endpoint: ..." (the value may carry user:password@)
        raise TierConfigError(
            "AWS_ENDPOINT_URL (or the profile's endpoint_url) is not a URL: give http(s)://host:port"
        ) from exc
    except s3_errors.SETUP_ERRORS as exc:  # AWS_PROFILE naming no profile, a region botocore refuses
        raise TierConfigError(f"S3 setup: {redact.text(str(exc))[:300]}") from exc


class ObjectChanged(TierUnavailable):
    """The object a download began with was replaced while it was read (its ETag no longer matches)."""


class S3Tier:
    name = "offsite"
    checksums = True

    def __init__(
        self,
        uri: str,
        *,
        part_size: int = 64 * MiB,
        concurrency: int = 8,
        immutable_days: int | None = None,
        client: Any = None,
    ) -> None:
        if not 5 * MiB <= part_size <= 5 * GiB:
            raise TierConfigError("S3 multipart part size must be at least 5 MiB and at most 5 GiB")
        self.bucket, self.prefix = parse_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.part_size = part_size
        self.concurrency = max(1, concurrency)
        self.immutable_days = immutable_days
        self._client = client or _client(self.concurrency)
        # Whether the server keeps each object's CRC32C (and so vouches for what it received): assumed until
        # a HEAD or an upload's answer lacks it (some servers keep none, or only a per-part composite); from
        # then on what this tier places is read back, as on a filesystem.
        self.checksums = True
        # For messages: an endpoint URL may carry user:password@, which is never printed.
        self.endpoint = re.sub(r"//[^/@]*@", "//", str(self._client.meta.endpoint_url))
        # The newer arguments (checksums, conditions) this server refused as unsupported: not sent again by
        # any tier of this process on the same endpoint.
        self.refused: set[str] = _REFUSED.setdefault(self.endpoint, set())
        if self.refused & set(s3_newer.CHECKSUMS):  # what it was sent without it cannot vouch for
            self.checksums = False

    # -- errors -------------------------------------------------------------------

    def _error(self, exc: Exception, key: str = "") -> Exception:
        return s3_errors.tier_error(exc, self.bucket, self.endpoint, key)

    def _call(self, op: str, key: str = "", **kwargs: Any) -> Any:
        try:
            return getattr(self._client, op)(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, key) from exc

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _lock(self) -> dict[str, Any]:
        if not self.immutable_days:
            return {}
        until = datetime.now(UTC) + timedelta(days=self.immutable_days)
        return {"ObjectLockMode": "COMPLIANCE", "ObjectLockRetainUntilDate": until}

    # -- the interface ------------------------------------------------------------------

    def check(self) -> None:
        """Fail fast with one clear error: bucket missing, credentials wrong, endpoint down."""
        self._call("head_bucket")

    def stat(self, key: str) -> ObjectInfo:
        k = self._key(key)
        head = self._head(k)
        crc = head.get("ChecksumCRC32C")
        if crc and "-" in crc:
            crc = None  # a composite (per-part) checksum is not the object's CRC32C
        if crc is None:
            self._keeps_no_checksums()
        return ObjectInfo(key, int(head["ContentLength"]), crc)

    def _head(self, k: str) -> Any:
        """The object's HEAD, its CRC32C asked for (``ChecksumMode``). A server that answers that HEAD 400 or
        501 (no body, so no reason) and one without the mode not, refuses the mode: not asked for again (what
        it holds is then read back to be verified); an answer the same without it is the object's own."""
        if s3_newer.CHECKSUM_MODE in self.refused:
            return self._call("head_object", k, Key=k)
        try:
            return self._client.head_object(Bucket=self.bucket, Key=k, ChecksumMode="ENABLED")
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status not in (400, 501):
                raise self._error(exc, k) from exc
        except BotoCoreError as exc:
            raise self._error(exc, k) from exc
        head = self._call("head_object", k, Key=k)
        s3_newer.record_refused(self, (s3_newer.CHECKSUM_MODE,), "head_object")
        return head

    def _keeps_no_checksums(self) -> None:
        if self.checksums:
            log.warning(
                "%s: an object without a full-object CRC32C (the server keeps none, or only per part): "
                "what Rewind places or finds there is read back to be verified",
                self.uri,
            )
        self.checksums = False

    def _vouched(self, key: str, answer: dict[str, Any], crc32c: str, size: int) -> None:
        """An upload's object as the server acknowledged it: its CRC32C, or else the bytes read back and
        held to ``crc32c``; a copy that differs is deleted (``TierUnavailable``: sending again may do)."""
        if answer.get("ChecksumCRC32C") == crc32c:
            return
        self._keeps_no_checksums()
        hasher, k = digest.Hasher(), self._key(key)
        with self.open(key) as body:
            while chunk := body.read(digest.CHUNK):
                hasher.update(chunk)
        got = hasher.result()
        if got.size != size or got.crc32c != crc32c:
            if not s3_newer.ours(self, k, answer):  # another writer's, past a HEAD: never deleted
                raise AlreadyExists(f"s3://{self.bucket}/{k} was written by another writer meanwhile")
            self._call("delete_object", k, Key=k)
            raise TierUnavailable(f"s3://{self.bucket}/{k} did not arrive as sent (read back); deleted")

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        full = self._key(prefix)
        token: dict[str, str] = {}
        while True:
            page = self._call("list_objects_v2", full, Prefix=full, **token)
            for obj in page.get("Contents", []):
                key = obj["Key"][len(self.prefix) + 1 :] if self.prefix else obj["Key"]
                yield ObjectInfo(key, int(obj["Size"]), None)
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def capacity(self) -> int | None:
        return None  # a bucket has no size to hold an object to; reads stop at the size recorded

    def open(self, key: str) -> BinaryIO:
        """A stream of the object; one larger than a part is fetched as ``concurrency`` ranges in flight."""
        k = self._key(key)
        r = self._first_range(k)
        total, etag = _total_size(r), r.get("ETag")
        partial = r.get("ResponseMetadata", {}).get("HTTPStatusCode") == 206
        if partial and (total is None or not etag):  # a range we cannot place or pin: one plain GET instead
            r["Body"].close()
            r = self._call("get_object", k, Key=k)
        if not partial or total is None or not etag or total <= int(r["ContentLength"]):
            return _Body(r["Body"], self, k)  # type: ignore[return-value]
        fetch = lambda a, b: self._range(k, a, b, str(etag))  # noqa: E731
        try:
            with _Body(r["Body"], self, k) as head:
                first = head.read()
        except TierUnavailable as exc:  # the first part's body cut short: asked for again, as every range is
            log.info("%s: the first part of %s asked for again (%s)", self.uri, k, exc)
            first = fetch(0, int(r["ContentLength"]))
        return RangedBody(fetch, first, total, part=self.part_size, window=self.concurrency)  # type: ignore[return-value]

    def _first_range(self, k: str) -> Any:
        """The object's first part (a server that ignores ``Range`` answers 200 with all of it)."""
        try:
            return self._client.get_object(Bucket=self.bucket, Key=k, Range=f"bytes=0-{self.part_size - 1}")
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if exc.response.get("Error", {}).get("Code") != "InvalidRange" and status != 416:
                raise self._error(exc, k) from exc
        except BotoCoreError as exc:
            raise self._error(exc, k) from exc
        return self._call("get_object", k, Key=k)  # an empty object has no byte 0

    def _range(self, k: str, start: int, end: int, etag: str) -> bytes:
        """Bytes [start, end) of the object ``etag`` names, asked for again (``RANGE_TRIES`` in all) where a
        try failed for now: botocore retries a request until its answer's headers came, not a body cut
        short (a connection reset mid-way), and a restore of a large object must not start over for one.
        Another object under ``k`` is an error at once."""
        for attempt in range(1, RANGE_TRIES + 1):
            try:
                return self._range_once(k, start, end, etag)
            except ObjectChanged:
                raise
            except TierUnavailable as exc:
                if attempt == RANGE_TRIES:
                    raise
                log.info("%s: bytes %d-%d asked for again (%s)", self.uri, start, end - 1, exc)
                time.sleep(RANGE_BACKOFF_S * 2 ** (attempt - 1))
        raise AssertionError("unreachable: the last try raises")  # pragma: no cover

    def _range_once(self, k: str, start: int, end: int, etag: str) -> bytes:
        try:
            r = self._client.get_object(
                Bucket=self.bucket, Key=k, Range=f"bytes={start}-{end - 1}", IfMatch=etag
            )
            with _Body(r["Body"], self, k) as body:
                if int(r.get("ContentLength", -1)) != end - start:  # checked before the body is held
                    raise TierUnavailable(
                        f"s3://{self.bucket}/{k}: asked for {end - start} bytes at {start},"
                        f" the server sends {r.get('ContentLength')}"
                    )
                data = body.read()
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status == 412:
                raise ObjectChanged(f"s3://{self.bucket}/{k} changed while it was being read") from exc
            raise self._error(exc, k) from exc
        except BotoCoreError as exc:
            raise self._error(exc, k) from exc
        if len(data) != end - start:
            raise TierUnavailable(
                f"s3://{self.bucket}/{k}: asked for {end - start} bytes at {start}, got {len(data)}"
            )
        return data

    def delete(self, key: str) -> None:
        """A missing key is no error: S3 answers its DELETE 204, GCS's XML API 404 (a gc cut short after
        deleting a copy's manifest must finish at its next run there too)."""
        k = self._key(key)
        with contextlib.suppress(ObjectNotFound):
            self._call("delete_object", k, Key=k)

    def abandon(self, prefix: str) -> int:
        """Abort every unfinished multipart upload under ``prefix`` (a push cut short, then its copy deleted)."""
        full, n = self._key(prefix), 0
        for upload in s3_multipart.uploads(self, full):
            self._call(
                "abort_multipart_upload", upload["Key"], Key=upload["Key"], UploadId=upload["UploadId"]
            )
            n += 1
        return n

    def put_bytes(self, key: str, data: bytes, *, crc32c: str) -> None:
        k = self._key(key)
        base = {"Key": k, "Body": data, "ContentLength": len(data), **self._lock()}
        newer = {s3_newer.CHECKSUM: {"ChecksumCRC32C": crc32c}}
        instead = {s3_newer.CHECKSUM: s3_newer.md5_of(data)}
        answer = s3_newer.call(self, "put_object", k, base, newer, creates=True, instead=instead)
        self._vouched(key, answer, crc32c, len(data))

    def copy(self, src_key: str, dst_key: str, *, crc32c: str) -> None:
        """CopyObject, CRC32C asked for and ``IfNoneMatch='*'`` as every upload has (nothing overwritten).

        What the copy's checksum proves depends on the server: SeaweedFS (and AWS S3, as documented)
        carries the source's stored CRC32C over, the one it checked when the source was uploaded;
        the caller's check after the copy holds that to the manifest. A source whose stored checksum
        is already another (or none) is not copied at all. Over 5 GiB a copy would take a multipart
        copy; such an object is sent again instead. Both: ``NotCopied``.
        """
        if self.refused:  # a server refusing checksums or conditions: the bytes go up instead
            raise NotCopied(f"{self.endpoint} refuses {', '.join(sorted(self.refused))}: sent, not copied")
        info = self.stat(src_key)
        if info.crc32c != crc32c:
            raise NotCopied(f"s3://{self.bucket}/{self._key(src_key)} has crc32c {info.crc32c}, not {crc32c}")
        if info.size > MAX_COPY:
            raise NotCopied(f"s3://{self.bucket}/{self._key(src_key)} is over 5 GiB: sent, not copied")
        src, k = self._key(src_key), self._key(dst_key)
        try:
            self._client.copy_object(
                Bucket=self.bucket,
                Key=k,
                CopySource={"Bucket": self.bucket, "Key": src},
                ChecksumAlgorithm="CRC32C",
                IfNoneMatch="*",
                **self._lock(),
            )
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if s3_errors.unsupported(exc):  # no CopyObject, or none with a checksum: the bytes go up instead
                raise NotCopied(f"{self.endpoint} does not copy objects so ({code})") from exc
            if code in ("NoSuchKey", "404", "NotFound"):  # the source went away after the stat (retention)
                raise ObjectNotFound(f"s3://{self.bucket}/{src} does not exist (copy source)") from exc
            raise self._error(exc, k) from exc
        except ParamValidationError as exc:  # a botocore older than CopyObject's IfNoneMatch (October 2025)
            raise NotCopied(
                f"botocore {botocore.__version__} cannot ask CopyObject not to overwrite: sent, not copied"
            ) from exc
        except BotoCoreError as exc:
            raise self._error(exc, k) from exc

    def put(self, key: str, src: Path, *, crc32c: str) -> int:
        size = src.stat().st_size
        if size <= self.part_size:
            self.put_bytes(key, src.read_bytes(), crc32c=crc32c)
            progress.advance(size)
            return size
        return s3_multipart.upload(self, key, src, size, crc32c)


def _total_size(response: dict[str, Any]) -> int | None:
    """The object's size from a ranged GET's ``Content-Range: bytes a-b/total`` (None if it sent no range)."""
    m = re.fullmatch(r"bytes \d+-\d+/(\d+)", str(response.get("ContentRange", "")))
    return int(m.group(1)) if m else None


class _Body:
    """A downloaded object's stream whose errors mid-read are Rewind's (``TierUnavailable``), like every call's."""

    def __init__(self, body: Any, tier: S3Tier, key: str) -> None:
        self._body, self._tier, self._key = body, tier, key

    def read(self, n: int = -1) -> bytes:
        try:
            return self._body.read(n) if n >= 0 else self._body.read()
        except (BotoCoreError, ClientError, OSError) as exc:
            raise self._tier._error(exc, self._key) from exc

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> _Body:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
