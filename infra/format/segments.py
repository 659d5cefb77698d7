"""Segment digests: the xxh3-128 of each ``SEGMENT`` bytes of a file, so one file is hashed on every core.

A file's manifest entry holds one xxh3 over all of it, which one core computes (about 15 GB/s here). A copy
in the memory tier is read at memory speed, so that one core is most of a restore from it. When the memory
agent writes a copy, the writer hashes each segment of each file as well as the whole, over the same bytes
(``digest.Hasher(segment=...)``), and the whole must match the manifest before the copy is registered: the
segment digests are of proven bytes, and are recorded in the catalog with the copy (``replica.segments``),
never in the copy. A restore from that copy then proves every segment against the catalog's record, in
parallel (``mapped``), before any byte is used: the same rule as the whole-file digest, held per segment.

Anything that does not fit (another segment size, a count that does not cover the file, a malformed
record) is ignored: the file is hashed whole against its manifest entry, as any other copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace

from rewind.infra.format import manifest as mf

SEGMENT = 4 << 20  # small enough that a segment just hashed is still in the cache when it is copied
MAX_RECORD = 16 << 20  # a record larger than this is not read (about 1.9 TB of files at 4 MiB a segment)
_HEX = re.compile(r"[0-9a-f]{32}")


def count(size: int) -> int:
    """How many segments cover ``size`` bytes (the last one may be shorter)."""
    return -(-size // SEGMENT)


def dumps(per_file: Mapping[str, tuple[str, ...]]) -> str | None:
    """The catalog's record of a copy's segment digests; None when there are none."""
    if not per_file:
        return None
    return json.dumps({"segment": SEGMENT, "files": {p: list(d) for p, d in per_file.items()}})


def attach(manifest: mf.Manifest, record: str | None) -> mf.Manifest:
    """``manifest`` (held to the catalog already) with each file's recorded segment digests, where the record
    has a fitting list for it; unchanged where it has none."""
    files = _parsed(record)
    if not files:
        return manifest
    entries = tuple(_with(e, files.get(e.path)) for e in manifest.files)
    return replace(manifest, files=entries)


def _parsed(record: str | None) -> dict[str, object]:
    if not record or len(record) > MAX_RECORD:
        return {}
    try:
        raw = json.loads(record)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(raw, dict) or raw.get("segment") != SEGMENT or not isinstance(raw.get("files"), dict):
        return {}
    return raw["files"]


def _with(entry: mf.FileEntry, digests: object) -> mf.FileEntry:
    if not isinstance(digests, list) or len(digests) != count(entry.size) or not digests:
        return entry
    if not all(isinstance(d, str) and _HEX.fullmatch(d) for d in digests):
        return entry
    return replace(entry, segments=tuple(digests))
