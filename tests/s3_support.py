"""A real S3 server on loopback for the tests: SeaweedFS (`weed mini`), started by ``rewind.infra.drills.servers``
(the drills start the same one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rewind.infra.drills.servers import ACCESS_KEY, SECRET_KEY, SeaweedS3, weed_binary

BUCKET = "rewind"  # created by the ``s3`` fixture

__all__ = ["ACCESS_KEY", "BUCKET", "SECRET_KEY", "SeaweedS3", "big_checkpoint", "weed_binary"]


def big_checkpoint(run: str, root: Path, mb: int = 260):  # type: ignore[no-untyped-def]
    """A real multi-file checkpoint of ``mb`` MB (model + optimizer + rng + state.json)."""
    import torch

    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.checkpoint.state import RNGState

    torch.manual_seed(0)
    n = mb * (1 << 20) // 4 // 3  # params + two Adam moments
    model = torch.nn.Linear(n // 1024, 1024, bias=False)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, n // 1024)).sum().backward()
    opt.step()
    ck = Checkpointer(
        run, states={"model": model, "optimizer": opt, "rng": RNGState()}, root=root, catalog=Catalog()
    )
    ck.save(1)
    return ck.last_saved


def _error(code: str, message: str) -> bytes:
    """An S3 error answer's body."""
    head = '<?xml version="1.0" encoding="UTF-8"?>'
    return f"{head}<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()


def _client(endpoint: str) -> Any:
    """A client of the test's S3 server itself (what a proxy looks up there)."""
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )  # fmt: skip


class ChecksumlessS3:
    """A real HTTP proxy on loopback in front of the test's S3 server that answers as a server keeping no
    CRC32C does (older Ceph RGW, GCS's XML API): every ``x-amz-checksum-*`` header and ``<Checksum...>``
    element is dropped from its answers. Requests pass unchanged (the signature covers the proxy's Host).

    ``refuses``: as a server that knows no checksums (``"checksum"``) or no conditional writes
    (``"if-none-match"``) and says so (``"checksum-mode"``: a HEAD asking to be shown the object's
    checksum is answered 400, without a body, as to any header it does not know), a write carrying an ``x-amz-checksum-*`` header or a
    ``<ChecksumCRC32C>`` element, or ``If-None-Match``, is answered 501 NotImplemented (counted in
    ``refused``) and not passed on; knowing no checksums, it requires ``Content-MD5`` on every PUT with
    a body instead (as an Object Lock bucket does). ``keeps_checksums``: its answers keep them.
    ``unlisted``: it answers as AWS answers credentials without s3:ListBucket: the bucket's HEAD and
    listing, and a HEAD or GET of an object that is not there, are refused (403; a HEAD's with no body).
    ``strict``: as AWS, it goes on with an upload in parts only as it was begun: one begun without a checksum
    is refused a part that carries one (400 InvalidRequest, a checksum type mismatch) or a completion that
    does (400 BadDigest). ``loses``: the upload in parts is found gone (404 NoSuchUpload) once, at the first
    look at its parts (``"parts"``: another sender completed or aborted it meanwhile), or at its first
    completion (``"completion"``: passed on, its answer replaced, as when the reply to a completion that
    succeeded is lost and its retry finds the upload gone); ``"copy"``: a server-side copy passed on, its
    answer replaced by 412 PreconditionFailed once, as the retry of a copy whose answer was lost (or another
    sender's copy landing first) finds its target there. ``composite``: as MinIO from its checksums (2023)
    to its full-object ones (2025), which keeps a checksum of its parts' checksums whatever was asked, a
    completion naming the whole object's CRC32C (``x-amz-checksum-crc32c``) is answered 400
    XAmzContentChecksumMismatch (counted in ``refused``). ``cuts``: the first ``cuts`` GETs of a range
    (the object's first included) have their connection closed halfway through the body (a reset
    mid-download; counted down in ``cuts``). ``missing_delete``: as GCS's XML API, a DELETE of a key that
    is not there is answered 404 NoSuchKey."""

    NOT_IMPLEMENTED = _error(
        "NotImplemented", "A header you provided implies functionality that is not implemented"
    )
    ACCESS_DENIED = _error("AccessDenied", "Access Denied")
    BAD_DIGEST = _error("BadDigest", "The CRC32C you specified did not match the calculated checksum.")
    TYPE_MISMATCH = _error(
        "InvalidRequest",
        "Checksum Type mismatch occurred, expected checksum Type: null, actual checksum Type: crc32c",
    )
    NO_SUCH_UPLOAD = _error("NoSuchUpload", "The specified upload does not exist.")
    NO_SUCH_KEY = _error("NoSuchKey", "The specified key does not exist.")
    PRECONDITION_FAILED = _error(
        "PreconditionFailed", "At least one of the pre-conditions you specified did not hold"
    )
    CHECKSUM_MISMATCH = _error(
        "XAmzContentChecksumMismatch",
        "The provided 'x-amz-checksum' header does not match what was computed.",
    )
    MD5_REQUIRED = _error(
        "InvalidRequest", "Content-MD5 OR x-amz-checksum- HTTP header is required for Put Object requests"
    )

    def __init__(
        self,
        upstream: str,
        *,
        refuses: frozenset[str] = frozenset(),
        keeps_checksums: bool = False,
        unlisted: bool = False,
        strict: bool = False,
        loses: str = "",
        composite: bool = False,
        cuts: int = 0,
        missing_delete: bool = False,
    ) -> None:
        import http.client
        import re
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        from botocore.exceptions import ClientError

        target = urlsplit(upstream)
        proxy = self
        self.refused = 0
        self.to_lose = 1 if loses else 0
        self.cuts = cuts
        self._claims = threading.Lock()
        looker = _client(upstream) if missing_delete else None
        begun_bare: set[str] = set()  # uploads begun without a checksum (``strict``)
        upload_id = re.compile(rb"<UploadId>([^<]+)</UploadId>")

        def _newer(headers: Any, body: bytes) -> bool:
            names = [k.lower() for k in headers]
            checksum = any(k.startswith("x-amz-checksum") for k in names) or b"<ChecksumCRC32C>" in body
            return ("checksum" in refuses and checksum) or (
                "if-none-match" in refuses and "if-none-match" in names
            )

        def _newer_parts(headers: Any, body: bytes) -> bool:
            return any(k.lower().startswith("x-amz-checksum") for k in headers) or b"<ChecksumCRC32C>" in body

        element = re.compile(rb"<Checksum(CRC32C|CRC32|CRC64NVME|SHA1|SHA256|Type)>[^<]*</Checksum\1>")

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                on_bucket = "/" not in self.path.split("?")[0].strip("/")
                if unlisted and on_bucket and self.command in ("HEAD", "GET"):
                    self._denied()
                    return
                query = self.path.partition("?")[2]
                names_upload = "uploadId=" in query and proxy.to_lose > 0
                if names_upload and loses == "parts" and self.command == "GET":
                    proxy.to_lose -= 1
                    self._answer(404, "Not Found", proxy.NO_SUCH_UPLOAD)
                    return
                lost_reply = names_upload and loses == "completion" and self.command == "POST"
                copies = "x-amz-copy-source" in [k.lower() for k in self.headers] and self.command == "PUT"
                lost_copy = loses == "copy" and copies and proxy.claim()  # one of the copies in flight
                mode = "x-amz-checksum-mode" in [k.lower() for k in self.headers]
                if "checksum-mode" in refuses and self.command == "HEAD" and mode:
                    proxy.refused += 1
                    self._answer(400, "Bad Request", b"")
                    return
                if composite and self._completes_with_whole_checksum(query):
                    proxy.refused += 1
                    self._answer(400, "Bad Request", proxy.CHECKSUM_MISMATCH)
                    return
                if missing_delete and self.command == "DELETE" and not query and self._upstream_lacks():
                    self._answer(404, "Not Found", proxy.NO_SUCH_KEY)
                    return
                if strict and self._goes_on_bare_with_checksum(query, body):
                    completes = self.command == "POST"
                    self._answer(400, "Bad Request", proxy.BAD_DIGEST if completes else proxy.TYPE_MISMATCH)
                    return
                if self.command in ("PUT", "POST") and _newer(self.headers, body):
                    proxy.refused += 1
                    self._answer(501, "Not Implemented", proxy.NOT_IMPLEMENTED)
                    return
                if (
                    "checksum" in refuses
                    and self.command == "PUT"
                    and body
                    and "Content-MD5" not in self.headers
                ):
                    self._answer(400, "Bad Request", proxy.MD5_REQUIRED)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    sent = {
                        k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")
                    }
                    conn.request(self.command, self.path, body=body, headers=sent)
                    answer = conn.getresponse()
                    data = answer.read() if self.command != "HEAD" else b""
                    if lost_reply and answer.status == 200:
                        proxy.to_lose -= 1
                        self._answer(404, "Not Found", proxy.NO_SUCH_UPLOAD)
                        return
                    if lost_copy and answer.status == 200:
                        self._answer(412, "Precondition Failed", proxy.PRECONDITION_FAILED)
                        return
                    if unlisted and answer.status == 404:
                        self._denied()
                        return
                    if strict and answer.status == 200:
                        self._note_begun(query, data)
                    data = data if keeps_checksums else element.sub(b"", data)
                    self.send_response(answer.status, answer.reason)
                    for name, value in answer.getheaders():
                        low = name.lower()
                        if (keeps_checksums or not low.startswith("x-amz-checksum")) and low not in (
                            "content-length",
                            "connection",
                        ):
                            self.send_header(name, value)
                    length = answer.getheader("Content-Length", "0") if self.command == "HEAD" else len(data)
                    self.send_header("Content-Length", str(length))
                    self.end_headers()
                    if self._cut(answer.status):
                        self.wfile.write(data[: len(data) // 2])  # then the connection goes
                        self.close_connection = True
                        return
                    self.wfile.write(data)
                finally:
                    conn.close()

            def _completes_with_whole_checksum(self, query: str) -> bool:
                names = [k.lower() for k in self.headers]
                return self.command == "POST" and "uploadId=" in query and "x-amz-checksum-crc32c" in names

            def _upstream_lacks(self) -> bool:
                """Whether the object this request names (path style) is not there: a HEAD of it, upstream."""
                from urllib.parse import unquote

                bucket, _, key = unquote(self.path.split("?")[0]).lstrip("/").partition("/")
                assert looker is not None
                try:
                    looker.head_object(Bucket=bucket, Key=key)
                except ClientError as exc:
                    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404
                return False

            def _cut(self, status: int) -> bool:
                """Whether this answer's body is cut short (``cuts``): a range's, the first one's included."""
                return self.command == "GET" and status == 206 and proxy.claim("cuts")

            def _goes_on_bare_with_checksum(self, query: str, body: bytes) -> bool:
                """A part or completion with a checksum, of an upload begun without one."""
                if self.command not in ("PUT", "POST") or "uploadId=" not in query:
                    return False
                if not _newer_parts(self.headers, body):
                    return False
                return query.split("uploadId=")[1].split("&")[0] in begun_bare

            def _note_begun(self, query: str, answer: bytes) -> None:
                """An upload begun without a checksum algorithm, remembered as such."""
                asked = any(k.lower() == "x-amz-checksum-algorithm" for k in self.headers)
                if self.command == "POST" and query.startswith("uploads") and not asked:
                    begun_bare.update(m.decode() for m in upload_id.findall(answer))

            def _denied(self) -> None:
                self._answer(403, "Forbidden", b"" if self.command == "HEAD" else proxy.ACCESS_DENIED)

            def _answer(self, status: int, reason: str, body: bytes) -> None:
                self.send_response(status, reason)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def claim(self, what: str = "to_lose") -> bool:
        """Whether a request in flight takes one of the faults still to make (``to_lose``, ``cuts``), counted
        down under a lock: requests in flight together take one each."""
        with self._claims:
            if getattr(self, what) <= 0:
                return False
            setattr(self, what, getattr(self, what) - 1)
            return True

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
