"""S3's errors as Rewind's: which mean bad credentials, bad input, an object not there or already there, and
which are transient (retried by the tasks); messages name the bucket and key, never a secret."""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    EndpointResolutionError,
    InvalidRegionError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    ProfileNotFound,
)

from rewind.infra import redact
from rewind.infra.tiers.base import (
    AlreadyExists,
    ChecksumModeMismatch,
    DigestRefused,
    ObjectNotFound,
    TierAccessDenied,
    TierConfigError,
    TierUnavailable,
    UploadGone,
)

DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AccessDeniedException",
}
TRANSIENT = {
    "InternalError",
    "SlowDown",
    "ServiceUnavailable",
    "RequestTimeout",
    "XAmzContentSHA256Mismatch",
    "InvalidDigest",
}
# The bytes, or the parts, are not those the request's checksum names (MinIO's name for it, before its
# full-object checksums: the answer to a completion naming the whole object's CRC32C, which it never computes)
DIGEST_REFUSED = {"BadDigest", "XAmzContentChecksumMismatch"}
# What servers answer to an argument they do not support (a checksum, a condition newer than their API)
UNSUPPORTED = {"InvalidArgument", "InvalidRequest", "NotSupported", "UnsupportedArgument"}
# Errors of the setup (a profile, a region, a parameter botocore refuses before sending): no retry helps
SETUP_ERRORS = (ParamValidationError, ProfileNotFound, NoRegionError, InvalidRegionError)


def tier_error(exc: Exception, bucket: str, endpoint: str, key: str = "") -> Exception:
    """``exc`` from boto3 as Rewind's error for the tier: denied, unavailable (transient), bad input, not
    found or already there. ``endpoint`` has no user:password in it (it is printed)."""
    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if isinstance(exc, NoCredentialsError):
        return TierAccessDenied(
            "no S3 credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        )
    if isinstance(exc, EndpointConnectionError):
        return TierUnavailable(f"S3 endpoint {endpoint} is unreachable")
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code == "NoSuchBucket":
            return TierConfigError(f"S3 bucket {bucket!r} does not exist at {endpoint}")
        if code == "NoSuchUpload":
            return UploadGone(f"{where}: the upload in parts is no longer there")
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectNotFound(f"{where} does not exist")
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status == 412:
            return AlreadyExists(f"{where} already exists; replicas are never overwritten")
        if code == "NotImplemented" or status == 501:  # this server lacks the call: it never will have it
            return TierConfigError(
                f"S3 server at {endpoint} does not implement a call Rewind made at {where}"
            )
        if code == "InvalidObjectState":  # a GET of an object a lifecycle rule moved to an archive class
            return TierConfigError(
                f"{where} is archived (its storage class keeps it offline): restore it from the archive"
                " first (S3 RestoreObject), then read it again"
            )
        if code in DENIED or status == 403:
            return TierAccessDenied(f"S3 refused the credentials for {where} ({code or status}{_bare(code)})")
        if code in DIGEST_REFUSED:
            return DigestRefused(f"S3 error at {where}: {code}: {err.get('Message', '')}")
        if code in TRANSIENT or status >= 500:
            return TierUnavailable(f"S3 error at {where}: {code or status}")
        said = f"S3 error at {where}: {code or status}: {err.get('Message', '')}"
        return (
            ChecksumModeMismatch(said)
            if _mode_mismatch(code, str(err.get("Message", "")))
            else TierConfigError(said)
        )
    if isinstance(exc, EndpointResolutionError):  # no request can ever go there: bad input, not an outage
        return TierConfigError(f"S3 endpoint {endpoint} is not a valid URL (AWS_ENDPOINT_URL)")
    if isinstance(exc, SETUP_ERRORS):
        return TierConfigError(f"S3 setup for {where}: {redact.text(str(exc))[:300]}")
    if isinstance(exc, BotoCoreError | OSError):
        return TierUnavailable(f"S3 endpoint {endpoint}: {redact.text(str(exc))}")
    return exc


def _mode_mismatch(code: str, message: str) -> bool:
    """A refusal of a checksum on an upload begun without one: at a part ('Checksum Type mismatch occurred,
    expected checksum Type: null, ...'), or at the completion ('The upload was created using a null
    checksum...', as some servers say; AWS's documented answer there is ``BadDigest``)."""
    said = message.lower()
    return code == "InvalidRequest" and "checksum" in said and ("mismatch" in said or "created using" in said)


def _bare(code: str) -> str:
    """What a refusal that names no bad key or signature (``AccessDenied``, or a bare 403: the answer to a
    HEAD) may mean: an action the credentials lack, s3:ListBucket above all, without which S3 answers 403
    for an object that is not there, and for the bucket's own HEAD."""
    if code not in ("403", "AccessDenied"):
        return ""
    return (
        ": the credentials may lack an action Rewind needs; without s3:ListBucket, S3 refuses the"
        " bucket's HEAD and answers 403 for an object that is not there"
    )


def unsupported(exc: ClientError) -> bool:
    """Whether the server refused the request as one it does not support: 501 ``NotImplemented``, or an
    argument error that says so (not one about the request's values: a checksum type that does not match
    the upload's, a bucket without Object Lock)."""
    err = exc.response.get("Error", {})
    code, message = str(err.get("Code", "")), str(err.get("Message", "")).lower()
    if code == "NotImplemented" or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 501:
        return True
    return code in UNSUPPORTED and any(
        w in message for w in ("not implemented", "not supported", "unsupported")
    )
