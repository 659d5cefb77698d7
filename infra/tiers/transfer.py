"""Moving one checkpoint copy between the local tier and another tier, checked end to end.

No catalog here: the caller hands in the manifest digest the catalog recorded, and
every copy is held to it. Push order on the target: every data file, then a check
that the target holds exactly the manifest's sizes and checksums, then the
manifest, last, as the commit marker. A target without the manifest holds no
checkpoint, whatever else it holds; a re-run sends only what is missing.

A copy lives at ``<run>/step-<N>`` on its tier, unless that name already holds a
different checkpoint of the same step (another timeline, after a roll-back and a
re-save): then it goes to ``<run>/step-<N>.<digest prefix>``, a name no other
manifest can claim.

Deduplication works at the manifest's file level, whatever the files are named
(plain parts, chunks, packs): a file of the new copy whose (size, xxh3, crc32c) an
earlier copy of the run on the same tier lists (its manifest held to the catalog's
digest) is copied there by the tier itself instead of sent, then held to its entry
exactly as an upload is. A copy that fails or does not match is sent instead.

Nothing on a tier is read past the size its manifest entry records (one byte more
shows a longer file), nor at all where that size is more than the tier can hold.
A download whose local write fails (disk full, read-only) raises ``DiskWriteError``:
the copy being read is not at fault. So does a push onto a filesystem tier that cannot be
written (its own ``put``/``copy`` say so); the manifest, last, is then never written.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from rewind.infra import progress
from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import files
from rewind.infra.format import keyring as kr
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import CHUNK, Hasher, hash_bytes, manifest_matches
from rewind.infra.format.verify import Budget, Finding, Problem, Report, check_manifest, not_a_file
from rewind.infra.tiers.base import (
    AlreadyExists,
    NotCopied,
    ObjectNotFound,
    Tier,
    TierUnavailable,
)

log = logging.getLogger("rewind.transfer")
FileId = tuple[int, str, str]  # (size, xxh3, crc32c): what makes two manifest entries the same bytes


@dataclass(frozen=True, slots=True)
class Reuse:
    """An earlier copy on the target tier to copy unchanged files from: its key and its catalog manifest digest."""

    key: str
    digest: str


@dataclass(frozen=True, slots=True)
class Pushed:
    """What a push cost: bytes sent through this process, and bytes the tier copied from earlier copies."""

    sent: int = 0
    reused: int = 0
    files_sent: int = 0
    files_reused: int = 0

    def __add__(self, other: Pushed) -> Pushed:
        return Pushed(
            self.sent + other.sent,
            self.reused + other.reused,
            self.files_sent + other.files_sent,
            self.files_reused + other.files_reused,
        )


def copy_key(run: str, step: int) -> str:
    return f"{run}/step-{step}"


def alternate_key(run: str, step: int, digest: str) -> str:
    return f"{copy_key(run, step)}.{digest[:16]}"


def read_manifest(tier: Tier, key: str) -> bytes:
    """A manifest from a tier, never more than ``manifest.MAX_BYTES`` of it held (ManifestError beyond, and
    for what is not a regular file)."""
    try:
        f = tier.open(key)
    except files.NotAFile as exc:
        raise mf.ManifestError(str(exc)) from exc
    with f:
        return mf.read_bounded(f)


def candidate_keys(run: str, step: int, digest: str) -> tuple[str, str]:
    """Where a copy of this checkpoint may live on a tier, in the order they are tried."""
    return copy_key(run, step), alternate_key(run, step, digest)


def holds(tier: Tier, key: str, digest: str) -> bool | None:
    """Does ``key`` hold this checkpoint's manifest (True), another one (False), or none (None)?"""
    try:
        raw = read_manifest(tier, f"{key}/{mf.MANIFEST_NAME}")
    except ObjectNotFound:
        return None
    except mf.ManifestError:
        return False  # something too large to be this checkpoint's manifest
    return manifest_matches(raw, digest)


def _stat_matches(
    tier: Tier, key: str, entry: mf.FileEntry, *, need_checksum: bool | None = False
) -> Finding | None:
    """Size and server-side CRC32C against ``entry``; with ``need_checksum``, a size alone proves nothing
    (None: where the tier still says, after this stat, that it keeps checksums)."""
    try:
        info = tier.stat(key)
    except ObjectNotFound:
        return Finding(Problem.MISSING, entry.path, f"not on the {tier.name} tier")
    except files.NotAFile as exc:
        return not_a_file(entry, exc)
    if info.size != entry.size:
        return Finding(
            Problem.SIZE, entry.path, f"{tier.name} holds {info.size} bytes, manifest says {entry.size}"
        )
    if need_checksum is None:
        need_checksum = tier.checksums
    if info.crc32c is None and need_checksum:
        return Finding(Problem.UNREADABLE, entry.path, f"the {tier.name} tier keeps no checksum to compare")
    if info.crc32c is not None and info.crc32c != entry.crc32c:
        return Finding(
            Problem.DIGEST, entry.path, f"{tier.name} crc32c {info.crc32c} != manifest {entry.crc32c}"
        )
    return None


def reuse_index(tier: Tier, sources: Sequence[Reuse]) -> dict[FileId, list[str]]:
    """Keys of the files earlier copies on ``tier`` hold, by content. Only a manifest that is the
    catalog's is read (bounded, like every manifest); one that is gone, unreadable or another is passed over."""
    index: dict[FileId, list[str]] = {}
    for src in sources:
        try:
            raw = read_manifest(tier, f"{src.key}/{mf.MANIFEST_NAME}")
            if not manifest_matches(raw, src.digest):
                log.warning("%s/%s: manifest is not the catalog's; not reused", tier.uri, src.key)
                continue
            files = mf.parse(raw).files
        except (ObjectNotFound, mf.ManifestError) as exc:
            log.warning("%s/%s: not reused (%s)", tier.uri, src.key, exc)
            continue
        for e in files:
            index.setdefault((e.size, e.xxh3, e.crc32c), []).append(f"{src.key}/{e.path}")
    return index


def _held(tier: Tier, target: str, entry: mf.FileEntry) -> Finding | None:
    """Is ``target`` already this file? The server's CRC32C vouches on S3; a filesystem's is read back, as is
    an object on a server that keeps no CRC32C (which it may show at this very stat)."""
    finding = _stat_matches(tier, target, entry, need_checksum=None)
    if finding is None and not tier.checksums:
        finding = _hash_remote(tier, target, entry)  # a read, not a write: cheaper than sending it again
    elif finding is None:
        progress.advance(entry.size)
    return finding


def _copy_from(tier: Tier, sources: Sequence[str], target: str, entry: mf.FileEntry) -> bool:
    """Copy ``entry`` to ``target`` from the first source that yields it, held to its entry like an upload."""
    for src in sources:
        try:
            tier.copy(src, target, crc32c=entry.crc32c)
        except ObjectNotFound:  # the earlier copy went meanwhile (retention): nothing wrong
            continue
        except NotCopied as exc:
            log.warning("%s: %s not copied from %s (%s)", tier.uri, target, src, exc)
            continue
        except AlreadyExists:  # placed meanwhile: another sender of the copy; or this copy, its answer lost
            return _held(tier, target, entry) is None  # not this file: the upload's own check says what
        finding = _stat_matches(tier, target, entry, need_checksum=tier.checksums)
        if finding is None:
            progress.advance(entry.size)
            return True
        log.warning("%s: copy of %s refused (%s)", tier.uri, src, finding)
        tier.delete(target)
    return False


FILE_STREAMS = 4  # files placed at once; a file over BIG_FILE goes alone (its parts are in flight together)
BIG_FILE = 64 << 20


def _place(tier: Tier, source: Path, key: str, e: mf.FileEntry, index: dict[FileId, list[str]]) -> Pushed:
    """Put one file of the manifest on the target; what that cost."""
    target = f"{key}/{e.path}"
    # A leftover is kept only if it proves to be this file; otherwise it is placed again.
    finding = _held(tier, target, e)
    if finding is None:
        return Pushed()
    if finding.problem is not Problem.MISSING:
        tier.delete(target)  # a leftover from an older, different attempt
    if _copy_from(tier, index.get((e.size, e.xxh3, e.crc32c), ()), target, e):
        return Pushed(reused=e.size, files_reused=1)
    try:
        return Pushed(sent=tier.put(target, source / e.path, crc32c=e.crc32c), files_sent=1)
    except AlreadyExists:  # placed meanwhile by another sender of the same copy: kept if it is this file
        again = _held(tier, target, e)
        if again is None:
            return Pushed()
        if again.problem is Problem.MISSING:  # gone again (the other sender's read-back refused it)
            raise TierUnavailable(f"{tier.uri}/{target} came and went while it was placed") from None
        raise CorruptCheckpoint(f"{tier.uri}/{key}", [again]) from None


def _place_all(
    tier: Tier,
    source: Path,
    key: str,
    files: Sequence[mf.FileEntry],
    index: dict[FileId, list[str]],
    on_file: Callable[[str, int], None] | None,
    streams: int,
) -> Pushed:
    """Every file, small ones ``streams`` at a time; ``on_file`` is called here, as each one lands."""
    done = Pushed()
    small = [e for e in files if e.size <= BIG_FILE]
    with ThreadPoolExecutor(max(1, streams), thread_name_prefix="rewind-push") as pool:
        futures = {
            pool.submit(contextvars.copy_context().run, _place, tier, source, key, e, index): e for e in small
        }
        try:
            for f in as_completed(futures):
                done += f.result()
                if on_file is not None:
                    on_file(futures[f].path, done.sent)
        finally:
            for f in futures:
                f.cancel()
    for e in files:
        if e.size > BIG_FILE:
            done += _place(tier, source, key, e, index)
            if on_file is not None:
                on_file(e.path, done.sent)
    return done


def push_files(
    source: Path, tier: Tier, key: str, files: Sequence[mf.FileEntry], streams: int = FILE_STREAMS
) -> int:
    """Place ``files`` of the copy at ``source`` under ``key`` (no manifest): one host's share of a
    checkpoint spread over hosts' disks. Each is checked as it lands; the bytes sent."""
    return _place_all(tier, source, key, files, {}, None, streams).sent


def push(
    source: Path,
    raw: bytes,
    tier: Tier,
    key: str,
    *,
    reuse: Sequence[Reuse] = (),
    on_file: Callable[[str, int], None] | None = None,
    streams: int = FILE_STREAMS,
) -> Pushed:
    """Copy a verified local copy (its manifest bytes ``raw``) to ``key`` on ``tier``; says what it cost.

    A file the target already holds (a resumed push) costs nothing; one an earlier copy in
    ``reuse`` holds is copied by the tier; the rest are sent, several at once. What each
    ``put`` or ``copy`` placed is checked as it goes (the server's CRC32C on S3, the bytes
    read back on a filesystem), so afterwards sizes are what is left to compare. The
    manifest goes last.
    """
    manifest = mf.parse(raw)
    index = reuse_index(tier, reuse)
    with progress.phase(f"send {key} to {tier.uri}", manifest.total_bytes):
        done = _place_all(tier, source, key, manifest.files, index, on_file, streams)
    bad = [f for e in manifest.files if (f := _stat_matches(tier, f"{key}/{e.path}", e))]
    if bad:
        raise CorruptCheckpoint(f"{tier.uri}/{key}", bad)
    tier.put_bytes(f"{key}/{mf.MANIFEST_NAME}", raw, crc32c=hash_bytes(raw).crc32c)
    return done


def _hash_remote(tier: Tier, key: str, entry: mf.FileEntry, budget: Budget | None = None) -> Finding | None:
    """Read the object back and compare it with ``entry``: never more than one byte past its size, every read
    charged to ``budget`` (``BudgetSpent`` when it runs out)."""
    h = Hasher(with_crc=False)
    size = 0
    try:
        body = tier.open(key)
    except files.NotAFile as exc:
        return not_a_file(entry, exc)
    with body:
        while size <= entry.size:
            want = min(CHUNK, entry.size + 1 - size)
            if budget is not None:
                budget.check()
                left = budget.left()
                want = want if left is None else min(want, left)
            chunk = body.read(want)
            if not chunk:
                break
            if budget is not None:
                budget.charge(len(chunk))
            h.update(chunk)
            size += len(chunk)
            progress.advance(len(chunk))
    if size != entry.size:
        return Finding(Problem.SIZE, entry.path, f"{tier.name} copy has {size} bytes, manifest {entry.size}")
    if h.result().xxh3 != entry.xxh3:
        return Finding(
            Problem.DIGEST, entry.path, f"{tier.name} copy xxh3 {h.result().xxh3} != manifest {entry.xxh3}"
        )
    return None


def _file_findings(
    tier: Tier, key: str, manifest: mf.Manifest, deep: bool, budget: Budget | None
) -> Iterator[Finding]:
    holds = tier.capacity()
    for e in manifest.files:
        impossible = files.beyond(e.size, holds)
        if impossible is not None:  # a sparse file can claim it; no real one can: judged unread
            yield Finding(Problem.SIZE, e.path, f"the manifest {impossible}")
            continue
        try:
            finding = _stat_matches(tier, f"{key}/{e.path}", e)
            if finding is None and deep:
                finding = _hash_remote(tier, f"{key}/{e.path}", e, budget)
        except (TierUnavailable, OSError) as exc:
            finding = Finding(Problem.UNREADABLE, e.path, str(exc))
        if finding is not None:
            yield finding


def check_remote(
    tier: Tier, key: str, expected: str, *, deep: bool, keyring: kr.Keyring, budget: Budget | None = None
) -> Report:
    """Every finding about the copy at ``key``: quick compares sizes and server checksums, deep re-hashes.

    ``BudgetSpent`` when ``budget`` runs out before the check is done (nothing is known then).
    """
    where = Path(f"{tier.uri}/{key}")
    try:
        raw = read_manifest(tier, f"{key}/{mf.MANIFEST_NAME}")
    except ObjectNotFound:
        return Report(
            where, None, (Finding(Problem.ABSENT, ".", f"no manifest on the {tier.name} tier"),), deep
        )
    except (TierUnavailable, OSError) as exc:
        return Report(where, None, (Finding(Problem.UNREADABLE, mf.MANIFEST_NAME, str(exc)),), deep)
    except mf.ManifestError as exc:
        return Report(where, None, (Finding(Problem.MANIFEST, mf.MANIFEST_NAME, str(exc)),), deep)
    manifest, findings = check_manifest(raw, expected, keyring)
    if manifest is None:
        return Report(where, None, tuple(findings), deep)
    reading = progress.phase(f"verify {tier.uri}/{key}", manifest.total_bytes)
    with reading if deep else contextlib.nullcontext():
        found = tuple(_file_findings(tier, key, manifest, deep, budget))
    return Report(where, manifest, found, deep)
