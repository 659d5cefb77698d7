"""The manifest: the last file written and the only proof a checkpoint is whole.

A directory without a manifest that parses, names only paths inside the
directory and matches every file's size and digest does not exist for restore.
The catalog records the SHA-256 of the manifest's bytes (:func:`digest.manifest_digest`):
that record, not the manifest's own word, is what a copy is checked against. With
a key configured (:mod:`rewind.infra.format.keyring`), manifests also carry the key's id and
an HMAC-SHA256, so a manifest stays checkable where the catalog is not at hand.

Format 2 added ``key_id``; format 3 added ``writer`` (what wrote the checkpoint) and
``parent_digest`` (the parent's manifest digest, so lineage can be rebuilt from storage
alone, exactly, even where two timelines share a step). Format 4 adds ``placement``: a checkpoint
whose ranks wrote to their own hosts' disks names the disk of each file that lies on one disk only
(``placement``, path -> disk id) and the host of each disk (``disks``); every other file is on every
disk's copy. Only such checkpoints are written as format 4 (an older Rewind refuses them as too new
rather than calling a partial copy damaged). Format 5: its ``state.json`` gives some tensors' layouts
(``tree``'s ``__strided__``), which an older Rewind would load as dicts; only such checkpoints are written
as format 5 (``placement`` is read in it too). Formats 1 to 3 are still read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from rewind.infra.errors import MalformedFile
from rewind.infra.format import files
from rewind.infra.format import keyring as kr
from rewind.infra.format.digest import DIGEST_ALGORITHM, manifest_digest

MANIFEST_NAME = "manifest.json"
MAX_BYTES = 64 << 20  # a manifest larger than this is refused unread: no real one comes near it
NAME_MAX = 255  # bytes in one path component on every filesystem Rewind writes to
FORMAT = "rewind.checkpoint/3"
PLACED_FORMAT = "rewind.checkpoint/4"  # with ``placement``: files spread over hosts' disks
LAID_OUT_FORMAT = "rewind.checkpoint/5"  # its state.json gives tensors' layouts (``tree``'s ``__strided__``)
READABLE_FORMATS = ("rewind.checkpoint/1", "rewind.checkpoint/2", FORMAT, PLACED_FORMAT, LAID_OUT_FORMAT)


class ManifestError(MalformedFile):
    """The manifest itself is unreadable or malformed."""


class ManifestTooNew(ManifestError):
    """Written by a newer Rewind (a later ``rewind.checkpoint/N``): says nothing about its bytes."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    xxh3: str
    crc32c: str
    # The xxh3 of each ``segments.SEGMENT`` bytes in turn: never in a manifest; what the catalog recorded
    # for a memory copy when its file was written (``rewind.infra.format.segments``), hashed in parallel.
    segments: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "xxh3": self.xxh3, "crc32c": self.crc32c}


@dataclass(frozen=True, slots=True)
class Manifest:
    run: str
    step: int
    files: tuple[FileEntry, ...]
    parent_step: int | None = None
    created_at: str = ""
    layout: dict[str, Any] = field(default_factory=lambda: {"world_size": 1, "tp": 1, "pp": 1, "dp": 1})
    environment: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    parent_digest: str | None = None
    # What wrote it: {"engine": "rewind.Checkpointer" | "rewind.ShardedCheckpointer" | "adopted:<format>", ...}
    writer: dict[str, str] = field(default_factory=dict)
    # Files on one disk only: path -> disk id (``local_tier``); the rest are on every disk's copy.
    placement: dict[str, str] = field(default_factory=dict)
    disks: dict[str, str] = field(default_factory=dict)  # disk id -> the host it belongs to
    # Its state.json gives tensors' layouts: an older Rewind, which would load them as dicts, refuses it.
    layouts: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def files_on(self, disk: str | None) -> tuple[FileEntry, ...]:
        """The files a copy on ``disk`` holds: all of them, unless the checkpoint is spread over disks
        and ``disk`` is one of them (then its own files and the ones every disk holds)."""
        if disk is None or disk not in self.disks:
            return self.files
        return tuple(f for f in self.files if self.placement.get(f.path, disk) == disk)

    def partial_on(self, disk: str | None) -> bool:
        return len(self.files_on(disk)) < len(self.files)

    def body(self) -> dict[str, Any]:
        placed = {"placement": self.placement, "disks": self.disks} if self.placement else {}
        return {
            **placed,
            "format": LAID_OUT_FORMAT if self.layouts else PLACED_FORMAT if self.placement else FORMAT,
            "digest": DIGEST_ALGORITHM,
            "run": self.run,
            "step": self.step,
            "parent_step": self.parent_step,
            "parent_digest": self.parent_digest,
            "writer": self.writer,
            "created_at": self.created_at,
            "layout": self.layout,
            "environment": self.environment,
            "metrics": self.metrics,
            "files": [f.as_dict() for f in self.files],
        }

    def to_bytes(self, keyring: kr.Keyring | None = None) -> bytes:
        """The bytes to write, signed with the current key (the environment's keyring by default)."""
        body = (keyring if keyring is not None else kr.from_env()).sign(self.body())
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"

    def digest(self, keyring: kr.Keyring | None = None) -> str:
        """Identity of the manifest bytes as written; recorded in the catalog."""
        return manifest_digest(self.to_bytes(keyring))


def contained(path: str) -> str:
    """Return ``path`` if, joined to a directory, it stays inside that directory; else raise."""
    p = PurePosixPath(path)
    parts = path.split("/")
    if not path or p.is_absolute() or "\\" in path or any(part in ("..", "", ".") for part in parts):
        raise ManifestError(f"manifest names path {path!r}, which escapes the checkpoint directory")
    try:
        encoded = [part.encode() for part in parts]
    except UnicodeEncodeError:
        raise ManifestError(f"manifest names path {path!r}, which no filesystem can hold") from None
    if "\0" in path or any(len(part) > NAME_MAX for part in encoded):
        raise ManifestError(f"manifest names path {path!r}, which no filesystem can hold")
    return str(p)


def safe_relative(path: str) -> str:
    """A data file path from a manifest: contained, and not the manifest itself."""
    p = PurePosixPath(contained(path))
    if p.name == MANIFEST_NAME:
        raise ManifestError(f"manifest lists itself as {path!r}")
    return str(p)


def _no_file_is_a_directory(paths: set[str]) -> None:
    """No listed file may also be a directory of another (``x`` and ``x/y``): no copy could hold both."""
    for path in paths:
        for parent in PurePosixPath(path).parents:
            if str(parent) in paths:
                raise ManifestError(f"manifest lists {str(parent)!r} as a file and a directory")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The manifest's JSON object, format checked; what a signature is verified over."""
    try:
        body = json.loads(raw)  # NaN/Infinity stay readable: a metric may be one; size and step are checked
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError, a 4300-digit number
        raise ManifestError(f"manifest is not valid JSON ({str(exc)[:200]})") from exc
    found = body.get("format") if isinstance(body, dict) else None
    version = str(found).removeprefix("rewind.checkpoint/")
    newest = max(int(f.rsplit("/", 1)[1]) for f in READABLE_FORMATS)
    if found not in READABLE_FORMATS and version.isdigit() and int(version) > newest:
        raise ManifestTooNew(f"manifest format is {found!r}, newer than this Rewind reads: upgrade it")
    if found not in READABLE_FORMATS:
        raise ManifestError(f"manifest format is {found!r}, expected one of {READABLE_FORMATS}")
    return body


def parse(raw: bytes) -> Manifest:
    """Structure only: whether the bytes are the ones the catalog recorded is the caller's check."""
    body = parse_body(raw)
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
        _no_file_is_a_directory(seen)
        parent, parent_digest = body.get("parent_step"), body.get("parent_digest")
        step = int(body["step"])
        if not 0 <= step < 2**63:
            raise ManifestError(f"manifest step {step} is out of range")
        return Manifest(
            run=str(body["run"]),
            step=step,
            files=tuple(files),
            parent_step=None if parent is None else int(parent),
            created_at=str(body.get("created_at", "")),
            layout=dict(body.get("layout") or {}),
            environment=dict(body.get("environment") or {}),
            metrics=dict(body.get("metrics") or {}),
            parent_digest=None if parent_digest is None else str(parent_digest),
            writer={str(k): str(v) for k, v in dict(body.get("writer") or {}).items()},
            layouts=body.get("format") == LAID_OUT_FORMAT,
            **_placement(body, seen),
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"manifest is missing or mistypes a field ({exc!r})") from exc


def _placement(body: dict[str, Any], listed: set[str]) -> dict[str, dict[str, str]]:
    """Format 4's placement, checked: every placed file is listed, every disk named has a host."""
    placement = {str(k): str(v) for k, v in dict(body.get("placement") or {}).items()}
    disks = {str(k): str(v) for k, v in dict(body.get("disks") or {}).items()}
    for path, disk in placement.items():
        if path not in listed or disk not in disks:
            raise ManifestError(f"manifest places {path!r} on disk {disk!r}, which it does not list")
    return {"placement": placement, "disks": disks}


def read_bounded(f: BinaryIO) -> bytes:
    """A manifest's bytes from an open stream, refusing one larger than ``MAX_BYTES`` before holding it."""
    raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ManifestError(f"manifest is larger than {MAX_BYTES} bytes")
    return raw


def read(directory: Path) -> Manifest:
    """The manifest of the copy in ``directory`` (structure only); never opens what is not a regular file."""
    try:
        with files.open_regular(directory, MANIFEST_NAME) as f:
            raw = read_bounded(f)
    except FileNotFoundError as exc:
        raise ManifestError(f"{MANIFEST_NAME} is missing") from exc
    except files.NotAFile as exc:
        raise ManifestError(str(exc)) from exc
    return parse(raw)


def signature(raw: bytes, keyring: kr.Keyring) -> kr.Signature:
    """How the manifest's signature stands against ``keyring`` (UNSIGNED when there is none)."""
    return keyring.check(parse_body(raw))
