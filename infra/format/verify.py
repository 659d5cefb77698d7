"""Checking one copy of a checkpoint against the manifest digest its catalog recorded.

Like restic's checker it keeps going and returns every finding instead of
stopping at the first, so a user sees all that is wrong at once. ``deep``
re-reads and re-hashes every byte; quick only checks the manifest, presence and
sizes. Findings say what kind of trouble a copy is in: damage (the bytes are not
the recorded ones), absence, or an I/O error that says nothing about the bytes.

Nothing a copy holds can keep a check going: what is not a regular file inside the
copy's directory (a FIFO, a device, a link leading out) is refused unopened, a file
claiming more bytes than its filesystem holds is judged by that claim, unread, no
file is read past its recorded size, and a ``Budget`` bounds the time and bytes of
a deep check (spent, it stops with ``BudgetSpent``: the copy is left unchecked).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import BinaryIO

from rewind.infra import progress
from rewind.infra.errors import CorruptCheckpoint, Refused
from rewind.infra.faults import fault_point
from rewind.infra.format import files, local_tier
from rewind.infra.format import keyring as kr
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import Hasher, HashingReader, manifest_matches


class Problem(StrEnum):
    MANIFEST = "manifest"  # missing, malformed, escaping path, not the catalog's, bad signature
    ABSENT = "absent"  # the whole copy is gone
    MISSING = "missing"  # a file the manifest lists is gone
    SIZE = "size_mismatch"
    DIGEST = "digest_mismatch"
    UNREADABLE = "unreadable"  # an I/O error: nothing is known about the bytes
    UNKNOWN_KEY = "unknown_key"  # signed with a key this keyring lacks: unverifiable
    UNSIGNED = "unsigned"  # refused only in strict mode
    CONTENT = "content"  # every byte matched, yet it does not decode into a state
    UNLISTED = "unlisted"  # a file the manifest does not name; reported, not fatal
    NOT_A_FILE = "not_a_file"  # a FIFO, device, socket or a link out of the copy where a file should be
    UNCHECKED = "unchecked"  # the check's budget was spent before it got there: nothing is known


UNVERIFIABLE = frozenset({Problem.UNREADABLE, Problem.UNKNOWN_KEY, Problem.UNCHECKED})
DEFAULT_BUDGET_S = 6 * 3600.0  # a scrub never runs longer than the interval between scrubs (rewind serve's)


class BudgetSpent(Refused):
    """A check's ``Budget`` ran out: what it had not checked yet is unchecked, neither good nor bad."""


@dataclass
class Budget:
    """What checks may spend: seconds from the budget's creation, and bytes read.

    Handed to several checks (a run's scrub), it bounds them together. Spent, the next read (or the next
    copy) raises ``BudgetSpent``. A read never takes more bytes than are left.
    """

    seconds: float | None = DEFAULT_BUDGET_S
    max_bytes: int | None = None
    read: int = field(default=0, init=False)
    started: float = field(default_factory=time.monotonic, init=False)

    def spent(self) -> str | None:
        """Why the budget is spent (one phrase), or None while it is not."""
        if self.seconds is not None and time.monotonic() - self.started >= self.seconds:
            return f"budget spent ({self.seconds:g}s)"
        if self.max_bytes is not None and self.read >= self.max_bytes:
            return f"budget spent ({self.max_bytes} bytes read)"
        return None

    def check(self) -> None:
        why = self.spent()
        if why is not None:
            raise BudgetSpent(why)

    def left(self) -> int | None:
        return None if self.max_bytes is None else max(self.max_bytes - self.read, 0)

    def charge(self, n: int) -> None:
        self.read += n


class _Metered:
    """A file whose reads are charged to a budget (and refused once it is spent)."""

    def __init__(self, raw: BinaryIO, budget: Budget) -> None:
        self._raw = raw
        self._budget = budget

    def readinto(self, view: memoryview) -> int:
        self._budget.check()
        left = self._budget.left()
        n = self._raw.readinto(view if left is None else view[:left]) or 0  # type: ignore[attr-defined]
        self._budget.charge(n)
        return n


class Verdict(StrEnum):
    """One copy's standing; the values are the catalog's replica statuses."""

    VERIFIED = "verified"
    CORRUPT = "corrupt"
    MISSING = "missing"
    UNVERIFIABLE = "unverifiable"


@dataclass(frozen=True, slots=True)
class Finding:
    problem: Problem
    path: str
    detail: str

    @property
    def fatal(self) -> bool:
        return self.problem is not Problem.UNLISTED

    def __str__(self) -> str:
        return f"{self.path}: {self.problem.value} ({self.detail})"

    def as_dict(self) -> dict[str, str]:
        return {"problem": self.problem.value, "path": self.path, "detail": self.detail}


def verdict_of(findings: tuple[Finding, ...] | list[Finding]) -> Verdict:
    """Damage anywhere makes a copy corrupt; I/O errors alone leave it unverifiable."""
    fatal = [f for f in findings if f.fatal]
    if not fatal:
        return Verdict.VERIFIED
    if all(f.problem is Problem.ABSENT for f in fatal):
        return Verdict.MISSING
    if all(f.problem in UNVERIFIABLE for f in fatal):
        return Verdict.UNVERIFIABLE
    return Verdict.CORRUPT


@dataclass(frozen=True, slots=True)
class Report:
    directory: Path
    manifest: mf.Manifest | None
    findings: tuple[Finding, ...]
    deep: bool

    @property
    def verdict(self) -> Verdict:
        return verdict_of(self.findings)

    @property
    def ok(self) -> bool:
        return self.manifest is not None and self.verdict is Verdict.VERIFIED


def check_manifest(
    raw: bytes, expected: str | None, keyring: kr.Keyring
) -> tuple[mf.Manifest | None, list[Finding]]:
    """The manifest, if these bytes are the ones the catalog recorded (``expected``) and signed acceptably.

    ``expected=None`` (no catalog record to hold it to) checks structure and signature only.
    """
    name = mf.MANIFEST_NAME
    if expected is not None and not manifest_matches(raw, expected):
        return None, [
            Finding(Problem.MANIFEST, name, f"not the manifest the catalog recorded ({expected[:16]}…)")
        ]
    try:
        manifest = mf.parse(raw)
        # Without a key nothing can be checked; the catalog's digest still holds the manifest.
        signature = mf.signature(raw, keyring) if keyring.signing else kr.Signature.VALID
    except mf.ManifestTooNew as exc:  # an older reader during a rolling upgrade: nothing is known
        return None, [Finding(Problem.UNREADABLE, name, str(exc))]
    except mf.ManifestError as exc:
        return None, [Finding(Problem.MANIFEST, name, str(exc))]
    if signature is kr.Signature.INVALID:
        return None, [
            Finding(Problem.MANIFEST, name, "HMAC does not match its key: the manifest was altered")
        ]
    if signature is kr.Signature.UNKNOWN_KEY:
        return None, [Finding(Problem.UNKNOWN_KEY, name, "signed with a key this keyring does not hold")]
    if signature is kr.Signature.UNSIGNED and keyring.strict:
        return None, [Finding(Problem.UNSIGNED, name, "unsigned, and REWIND_MANIFEST_STRICT refuses that")]
    return manifest, []


@contextlib.contextmanager
def open_for_read(directory: Path, rel: str) -> Iterator[BinaryIO]:
    """Open a checkpoint's file for a verifying read (the ``verify.read`` fault point fires here): only a
    regular file inside ``directory`` (``files.NotAFile`` otherwise, nothing opened)."""
    fault_point("verify.read")
    with files.open_regular(directory, rel, buffering=0) as f:
        yield f


def not_a_file(entry: mf.FileEntry, exc: files.NotAFile) -> Finding:
    return Finding(Problem.NOT_A_FILE, entry.path, str(exc))


def hash_entry(directory: Path, entry: mf.FileEntry, *, budget: Budget | None = None) -> Finding | None:
    """Re-read one file and compare size and xxh3 with ``entry``; I/O errors are findings too.

    ``BudgetSpent`` when ``budget`` runs out on the way.
    """
    try:
        with open_for_read(directory, entry.path) as f:
            reader = HashingReader(f if budget is None else _Metered(f, budget), Hasher(with_crc=False))  # type: ignore[arg-type]
            reader.finish(entry.size)
    except FileNotFoundError:
        return Finding(Problem.MISSING, entry.path, "listed in the manifest but not on disk")
    except files.NotAFile as exc:
        return not_a_file(entry, exc)
    except OSError as exc:
        return Finding(Problem.UNREADABLE, entry.path, exc.strerror or str(exc))
    return entry_mismatch(entry, reader.count, reader.hasher.result().xxh3)


def entry_mismatch(entry: mf.FileEntry, size: int, xxh3: str) -> Finding | None:
    if size != entry.size:
        return Finding(Problem.SIZE, entry.path, f"manifest says {entry.size} bytes, read {size}")
    if xxh3 != entry.xxh3:
        return Finding(Problem.DIGEST, entry.path, f"xxh3 {xxh3} != manifest {entry.xxh3}")
    return None


def check_entry(
    directory: Path,
    entry: mf.FileEntry,
    deep: bool,
    *,
    holds: int | None = None,
    budget: Budget | None = None,
) -> Finding | None:
    """One file against its entry: what lies there, its size (against the entry and against ``holds``, the
    size of the filesystem it lies on), and, when ``deep``, its bytes."""
    impossible = files.beyond(entry.size, holds)
    if impossible is not None:  # a sparse file can claim it; no real one can: judged unread
        return Finding(Problem.SIZE, entry.path, f"the manifest {impossible}")
    try:
        size = files.stat_regular(directory, entry.path).st_size
    except FileNotFoundError:
        return Finding(Problem.MISSING, entry.path, "listed in the manifest but not on disk")
    except files.NotAFile as exc:
        return not_a_file(entry, exc)
    except OSError as exc:
        return Finding(Problem.UNREADABLE, entry.path, exc.strerror or str(exc))
    if size != entry.size:
        return Finding(Problem.SIZE, entry.path, f"manifest says {entry.size} bytes, file has {size}")
    return hash_entry(directory, entry, budget=budget) if deep else None


def read_manifest_bytes(directory: Path) -> tuple[bytes | None, list[Finding]]:
    """The raw manifest of a local copy, or why there is none (absent copy, missing file, I/O error)."""
    try:
        with files.open_regular(directory, mf.MANIFEST_NAME) as f:
            return mf.read_bounded(f), []
    except (mf.ManifestError, files.NotAFile) as exc:
        return None, [Finding(Problem.MANIFEST, mf.MANIFEST_NAME, str(exc))]
    except FileNotFoundError:
        if not directory.is_dir():
            tier_root = directory.parent.parent  # <root>/<run>/step-<N>
            if not tier_root.is_dir():  # an unmounted disk looks like this too: say nothing about the copy
                why = f"{tier_root} does not exist (not mounted?), so neither does {directory}"
                return None, [Finding(Problem.UNREADABLE, ".", why)]
            return None, [Finding(Problem.ABSENT, ".", f"{directory} does not exist")]
        return None, [Finding(Problem.MANIFEST, mf.MANIFEST_NAME, "missing: the copy was never committed")]
    except OSError as exc:
        return None, [Finding(Problem.UNREADABLE, mf.MANIFEST_NAME, exc.strerror or str(exc))]


def check_copy(
    directory: Path,
    expected: str | None,
    *,
    deep: bool,
    keyring: kr.Keyring | None = None,
    budget: Budget | None = None,
) -> Report:
    """Every finding about the copy in ``directory``, held to the catalog's manifest digest ``expected``.

    ``BudgetSpent`` when ``budget`` runs out before the check is done (nothing is known then).
    """
    ring = keyring if keyring is not None else kr.from_env()
    raw, findings = read_manifest_bytes(directory)
    if raw is None:
        return Report(directory, None, tuple(findings), deep)
    manifest, findings = check_manifest(raw, expected, ring)
    if manifest is None:
        return Report(directory, None, tuple(findings), deep)
    holds = files.capacity(directory)
    listed_here = held_here(directory, manifest)
    checking = progress.phase(f"verify {_label(directory)}", sum(e.size for e in listed_here))
    with checking if deep else contextlib.nullcontext():
        findings = [
            f
            for e in listed_here
            if (f := check_entry(directory, e, deep, holds=holds, budget=budget)) is not None
        ]
    listed = {e.path for e in manifest.files} | {mf.MANIFEST_NAME}
    for root, _dirs, names in os.walk(directory):
        for name in names:
            rel = Path(root, name).relative_to(directory).as_posix()
            if rel not in listed:
                findings.append(Finding(Problem.UNLISTED, rel, "present on disk, not in the manifest"))
    return Report(directory, manifest, tuple(findings), deep)


def held_here(directory: Path, manifest: mf.Manifest) -> tuple[mf.FileEntry, ...]:
    """The files the copy in ``directory`` must hold: every file, or, for a copy on one of the disks a
    spread checkpoint was written to, that disk's own files and the shared ones, plus any other of the
    manifest's files it holds too (received from another disk: held to the manifest like the rest)."""
    if not manifest.placement:
        return manifest.files
    tier = local_tier.of_copy(directory)
    own = manifest.files_on(tier.id if tier is not None else None)
    return tuple(e for e in manifest.files if e in own or os.path.lexists(directory / e.path))


def partial(directory: Path, manifest: mf.Manifest) -> bool:
    """Whether the copy in ``directory`` holds only its disk's share of a spread checkpoint."""
    return len(held_here(directory, manifest)) < len(manifest.files)


def _label(directory: Path) -> str:
    """``run/step-N`` of a copy at ``<root>/<run>/step-<N>``, as progress names it."""
    return f"{directory.parent.name}/{directory.name}"


def require(report: Report) -> mf.Manifest:
    """The manifest of a copy that passed, else ``CorruptCheckpoint`` carrying every fatal finding."""
    if report.manifest is None or report.verdict is not Verdict.VERIFIED:
        raise CorruptCheckpoint(str(report.directory), [f for f in report.findings if f.fatal])
    return report.manifest


@contextlib.contextmanager
def open_entry(directory: Path, entry: mf.FileEntry) -> Iterator[BinaryIO]:
    """``entry``'s file opened for a verifying read: ``CorruptCheckpoint`` for a missing file or one that is
    not a regular file inside ``directory``."""
    try:
        with open_for_read(directory, entry.path) as f:
            yield f
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(
            str(directory), [Finding(Problem.MISSING, entry.path, "listed in the manifest but not on disk")]
        ) from exc
    except files.NotAFile as exc:
        raise CorruptCheckpoint(str(directory), [not_a_file(entry, exc)]) from exc


@contextlib.contextmanager
def verified_read(directory: Path, entry: mf.FileEntry) -> Iterator[HashingReader]:
    """One hashed read of a file; leaving the block proves the bytes read were exactly ``entry``'s.

    ``CorruptCheckpoint`` for a missing or different file (or no regular file at all); ``OSError`` for an
    I/O error. Whatever the block read is only to be used once the block has been left.
    """
    with open_entry(directory, entry) as f:
        reader = HashingReader(f, Hasher(with_crc=False))
        yield reader
        reader.finish(entry.size)  # a shorter or longer file must show, whatever the block read
    wrong = entry_mismatch(entry, reader.count, reader.hasher.result().xxh3)
    if wrong is not None:
        raise CorruptCheckpoint(str(directory), [wrong])


def read_verified(directory: Path, entry: mf.FileEntry) -> bytes:
    """A whole file, returned only if its bytes match ``entry``: the bytes hashed are the bytes used."""
    with verified_read(directory, entry) as reader:
        data = reader.read_all(limit=entry.size)
    return data


def verify_files(directory: Path, manifest: mf.Manifest) -> None:
    """Re-hash every file a manifest lists; ``CorruptCheckpoint`` with every finding if any differs."""
    with progress.phase(f"verify {_label(directory)}", manifest.total_bytes):
        findings = [f for e in manifest.files if (f := hash_entry(directory, e)) is not None]
    if findings:
        raise CorruptCheckpoint(str(directory), findings)
