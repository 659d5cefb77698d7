"""Fetching a copy from another tier onto this machine, nothing on trust.

``pull`` downloads a whole copy into the local tier with the commit protocol; ``peek`` reads only the
manifest and the few small files a caller names (a recovery choosing a restore point for a job that
fetches and hashes the rest itself); ``fetch_file`` reads one file of a copy into memory (a sharded
restore completing its disks' copies from the shared tier). Before any data is fetched the manifest
is held to the digest the catalog recorded (``pull``, ``peek``), or the caller holds a manifest already
proven (``fetch_file``); every file must hash to its entry before it is kept. Nothing is read past the
size its entry records (one byte more shows a longer file).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Collection
from pathlib import Path
from typing import BinaryIO

from rewind.infra import progress
from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import files, store
from rewind.infra.format import keyring as kr
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import CHUNK, hash_bytes
from rewind.infra.format.verify import Finding, Problem, check_manifest, not_a_file
from rewind.infra.tiers.base import ObjectNotFound, SourceFailed, Tier, disk_write_error
from rewind.infra.tiers.transfer import read_manifest


def proven_manifest(tier: Tier, key: str, expected: str, keyring: kr.Keyring) -> tuple[bytes, mf.Manifest]:
    """The copy's manifest bytes and manifest, held to the catalog's digest ``expected``;
    ``CorruptCheckpoint`` when it is absent, malformed or not the recorded one."""
    where = f"{tier.uri}/{key}"
    try:
        raw = read_manifest(tier, f"{key}/{mf.MANIFEST_NAME}")
    except ObjectNotFound as exc:
        raise CorruptCheckpoint(where, [Finding(Problem.ABSENT, ".", "no manifest on the tier")]) from exc
    except mf.ManifestError as exc:
        raise CorruptCheckpoint(where, [Finding(Problem.MANIFEST, mf.MANIFEST_NAME, str(exc))]) from exc
    manifest, findings = check_manifest(raw, expected, keyring)
    if manifest is None:
        raise CorruptCheckpoint(where, findings)
    return raw, manifest


def _stream(tier: Tier, key: str, entry: mf.FileEntry) -> Callable[[BinaryIO], None]:
    """A writer of the object's bytes, one byte past its entry's size at most (a longer one shows)."""

    def fill(out: BinaryIO) -> None:
        try:
            body = tier.open(f"{key}/{entry.path}")
        except ObjectNotFound as exc:
            finding = Finding(Problem.MISSING, entry.path, f"not on the {tier.name} tier")
            raise CorruptCheckpoint(f"{tier.uri}/{key}", [finding]) from exc
        except files.NotAFile as exc:
            raise CorruptCheckpoint(f"{tier.uri}/{key}", [not_a_file(entry, exc)]) from exc
        except OSError as exc:
            raise SourceFailed(exc) from exc
        with body:
            left = entry.size + 1
            while left > 0:
                try:
                    chunk = body.read(min(CHUNK, left))
                except OSError as exc:
                    raise SourceFailed(exc) from exc
                if not chunk:
                    break
                left -= len(chunk)
                out.write(chunk)  # an OSError here is the local disk's

    return fill


def pull(
    tier: Tier,
    key: str,
    expected: str,
    run_dir: Path,
    *,
    keyring: kr.Keyring,
    displace: store.Displace | None = None,
    segment: int = 0,
) -> store.Committed:
    """Download the copy at ``key`` into ``run_dir`` with the commit protocol (``segment``: each file's
    segment digests computed as it is written, returned with it).

    The manifest is held to the catalog's digest before any data is fetched, and
    every file must hash to its entry before the manifest is written locally; only
    then is a directory already at ``step-<N>/`` handed to ``displace``.
    ``CorruptCheckpoint`` (with findings) when the copy is not the recorded one; ``DiskWriteError`` when
    writing ``run_dir`` fails (disk full, read-only): the local disk's fault, not the copy's. An error
    reading the copy is raised as the tier raised it.
    """
    raw, manifest = proven_manifest(tier, key, expected, keyring)
    where = f"{tier.uri}/{key}"
    streams = [(e.path, _stream(tier, key, e)) for e in manifest.files]
    try:
        with progress.phase(f"fetch {key} from {tier.uri}", manifest.total_bytes):
            return store.write_checkpoint(
                run_dir, manifest, streams, copy_of=raw, displace=displace, segment=segment
            )
    except SourceFailed as failed:
        raise failed.error from None  # reading the copy failed: as the tier said it
    except OSError as exc:  # everything else that touches a disk here writes the local one
        raise disk_write_error(exc, f"the local disk at {run_dir}", where) from exc


def peek(
    tier: Tier, key: str, expected: str, into: Path, *, keyring: kr.Keyring, paths: Collection[str]
) -> mf.Manifest:
    """The copy's manifest (held to the catalog's digest) and only the files named in ``paths``, copied
    into the empty directory ``into``; the rest is left on the tier. Those files are not hashed here:
    the caller reads them through verification against the manifest (each byte hashed once)."""
    raw, manifest = proven_manifest(tier, key, expected, keyring)
    for e in manifest.files:
        if e.path not in paths:
            continue
        target = into / mf.safe_relative(e.path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as out:
                _stream(tier, key, e)(out)
        except SourceFailed as failed:
            raise failed.error from None
        except OSError as exc:  # writing the scratch directory: this machine's disk, not the copy
            raise disk_write_error(exc, f"the local disk at {into}", f"{tier.uri}/{key}") from exc
    try:
        (into / mf.MANIFEST_NAME).write_bytes(raw)
    except OSError as exc:
        raise disk_write_error(exc, f"the local disk at {into}", f"{tier.uri}/{key}") from exc
    return manifest


def fetch_file(tier: Tier, key: str, entry: mf.FileEntry) -> bytes:
    """One file of the copy at ``key``, in memory, once its bytes hash to ``entry`` (a manifest the caller
    already holds to the catalog); ``CorruptCheckpoint`` when they do not, the tier's error when unreadable."""
    buf = io.BytesIO()
    try:
        _stream(tier, key, entry)(buf)
    except SourceFailed as failed:
        raise failed.error from None
    data = buf.getvalue()
    got = hash_bytes(data)
    if (got.size, got.xxh3) != (entry.size, entry.xxh3):
        finding = Finding(
            Problem.DIGEST, entry.path, f"the {tier.name} tier's bytes differ from the manifest's"
        )
        raise CorruptCheckpoint(f"{tier.uri}/{key}", [finding])
    return data
