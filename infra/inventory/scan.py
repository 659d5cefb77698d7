"""Finding checkpoint copies on a tier by their manifests alone: no catalog needed.

A copy lies at ``<run>/step-<N>`` (or ``<run>/step-<N>.<digest16>`` for another
timeline) below the tier's root, with ``manifest.json`` in it. Anything under a
name starting with ``.`` (quarantine, staging, temporary directories) is not a copy.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rewind.infra import config
from rewind.infra.errors import ConfigError
from rewind.infra.format import manifest as mf
from rewind.infra.tiers import open_tier
from rewind.infra.tiers.base import Tier

LOCAL, SHARED, OFFSITE = "local", "shared", "offsite"
_STEP_DIR = re.compile(r"step-(\d{1,19})(\.[0-9a-f]{16})?")
MAX_STEP = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Place:
    """Where one copy lies on a tier, as its path names it."""

    key: str  # ``<run>/step-<N>[.<digest16>]`` below the tier root
    run: str
    step: int


def parse_key(key: str) -> Place | None:
    """The place a manifest key names, or None when it is not where a copy can lie."""
    parts = key.split("/")
    if len(parts) != 3 or parts[2] != mf.MANIFEST_NAME or any(p.startswith(".") or not p for p in parts[:2]):
        return None
    m = _STEP_DIR.fullmatch(parts[1])
    if m is None or int(m.group(1)) > MAX_STEP:
        return None
    return Place(f"{parts[0]}/{parts[1]}", parts[0], int(m.group(1)))


def places(tier: Tier, run: str | None = None) -> Iterator[Place]:
    """Every place on the tier holding a manifest (of ``run`` only, when given), in key order."""
    for info in tier.list(f"{run}/" if run else ""):
        place = parse_key(info.key)
        if place is not None:
            yield place


def tier_kind(uri: str, kind: str | None = None) -> str:
    """Which tier a URI is: given, else S3 is off-site, the checkpoint root is local, other paths shared."""
    if kind is not None:
        if kind not in (LOCAL, SHARED, OFFSITE):
            raise ConfigError(f"tier must be local, shared or offsite, not {kind!r}")
        return kind
    if uri.startswith("s3://"):
        return OFFSITE
    path = Path(uri.removeprefix("file://")).expanduser()
    return LOCAL if path.resolve() == config.checkpoint_root().resolve() else SHARED


def open_for_scan(uri: str, *, must_exist: bool = False) -> Tier:
    """The tier at ``uri``, spelled as the catalog's rows spell it (symlinks are not resolved).

    ``must_exist``: a path that is not there is bad input (a typo), not an empty tier.
    """
    if not uri.startswith("s3://"):
        path = Path(uri.removeprefix("file://")).expanduser().absolute()
        if must_exist and not path.is_dir():
            raise ConfigError(f"{path} is not a directory")
        uri = str(path)
    return open_tier(uri)
