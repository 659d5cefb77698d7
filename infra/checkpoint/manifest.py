"""The manifest: the last file written and the only proof a checkpoint is whole.

A directory without a manifest that parses, names only paths inside the
directory and matches every file's size and digest does not exist for restore.
With ``REWIND_MANIFEST_KEY`` set, manifests also carry an HMAC-SHA256 so that a
tampered manifest (not just a damaged one) is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from infra.digest import DIGEST_ALGORITHM, hash_bytes

MANIFEST_NAME = "manifest.json"
FORMAT = "rewind.checkpoint/1"
KEY_ENV = "REWIND_MANIFEST_KEY"


class ManifestError(ValueError):
    """The manifest itself is unreadable, malformed or fails its HMAC."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    xxh3: str
    crc32c: str

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "xxh3": self.xxh3, "crc32c": self.crc32c}


@dataclass(frozen=True, slots=True)
class Manifest:
    run: str
    step: int
    files: tuple[FileEntry, ...]
    parent_step: int | None = None
    created_at: str = ""
    layout: dict[str, int] = field(default_factory=lambda: {"world_size": 1, "tp": 1, "pp": 1, "dp": 1})
    environment: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "digest": DIGEST_ALGORITHM,
            "run": self.run,
            "step": self.step,
            "parent_step": self.parent_step,
            "created_at": self.created_at,
            "layout": self.layout,
            "environment": self.environment,
            "metrics": self.metrics,
            "files": [f.as_dict() for f in self.files],
        }

    def to_bytes(self) -> bytes:
        body = self.body()
        key = os.environ.get(KEY_ENV)
        if key:
            body["hmac_sha256"] = _mac(key, body)
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"

    def digest(self) -> str:
        """Identity of the manifest bytes as written; recorded in the catalog."""
        return hash_bytes(self.to_bytes()).xxh3


def _mac(key: str, body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key.encode(), canonical, hashlib.sha256).hexdigest()


def contained(path: str) -> str:
    """Return ``path`` if, joined to a directory, it stays inside that directory; else raise."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or "\\" in path or any(part in ("..", "") for part in path.split("/")):
        raise ManifestError(f"manifest names path {path!r}, which escapes the checkpoint directory")
    return str(p)


def safe_relative(path: str) -> str:
    """A data file path from a manifest: contained, and not the manifest itself."""
    p = PurePosixPath(contained(path))
    if p.name == MANIFEST_NAME:
        raise ManifestError(f"manifest lists itself as {path!r}")
    return str(p)


def parse(raw: bytes) -> Manifest:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"manifest is not valid JSON ({exc})") from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ManifestError(
            f"manifest format is {body.get('format') if isinstance(body, dict) else None!r}, expected {FORMAT!r}"
        )
    key = os.environ.get(KEY_ENV)
    mac = body.pop("hmac_sha256", None)
    if key and (mac is None or not hmac.compare_digest(mac, _mac(key, body))):
        raise ManifestError("manifest HMAC does not match: tampered, or written with another key")
    try:
        files = []
        seen: set[str] = set()
        for f in body["files"]:
            path = safe_relative(str(f["path"]))
            if path in seen:
                raise ManifestError(f"manifest lists {path!r} twice")
            seen.add(path)
            size = int(f["size"])
            if size < 0:
                raise ManifestError(f"manifest gives {path!r} a negative size")
            files.append(FileEntry(path=path, size=size, xxh3=str(f["xxh3"]), crc32c=str(f["crc32c"])))
        return Manifest(
            run=str(body["run"]),
            step=int(body["step"]),
            files=tuple(files),
            parent_step=body.get("parent_step"),
            created_at=str(body.get("created_at", "")),
            layout=dict(body.get("layout") or {}),
            environment=dict(body.get("environment") or {}),
            metrics=dict(body.get("metrics") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"manifest is missing or mistypes a field ({exc!r})") from exc


def read(directory: Path) -> Manifest:
    try:
        raw = (directory / MANIFEST_NAME).read_bytes()
    except FileNotFoundError as exc:
        raise ManifestError(f"{MANIFEST_NAME} is missing") from exc
    return parse(raw)
