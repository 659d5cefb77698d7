"""Room in a host's memory tier for the peer ring's copies, and which ones may be let go to make it.

Ring copies live on the memory filesystem, not in a process: they outlive the run that made them. While a
run's leader lives on a host it holds its run's lock there (``Live``: a shared ``flock`` on
``.ring/<run>/.live``, released by the kernel when the process ends however it ends). When a pass needs
room its budget does not have, other runs' ring copies whose lock no process holds (their run ended on
this host: it finished, or it failed and has not come back) are let go, oldest made first, until the
incoming share fits; a live run's copies are never let go by another run.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from rewind.infra.catalog import copies as catalog_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.held import ring_held_by
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.format import manifest as mf
from rewind.infra.format import store

log = logging.getLogger("rewind.ring")
RING_DIR = ".ring"  # no run is named with a leading dot: never a run's memory copy
LIVE = ".live"


class Live:
    """A leader's hold on its run's ring copies on this host, for as long as it lives (or until ``close``)."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(
            run_dir / LIVE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
        )
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # another run's eviction holds it only while it removes
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def run_dir(root: Path, run: str) -> Path:
    return root / RING_DIR / mf.safe_relative(run)


def tier_bytes(root: Path) -> int:
    """What this memory tier holds now: every run's copies, the keeper's and the ring's."""
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def copies(of_run: Path) -> list[Path]:
    """A run's complete ring copies on this node, newest made first."""
    found = [d for d in of_run.glob("step-*-*") if (d / mf.MANIFEST_NAME).is_file()]
    return sorted(found, key=lambda d: (d / mf.MANIFEST_NAME).stat().st_mtime_ns, reverse=True)


def sweep(of_run: Path) -> None:
    """Transfers left unfinished by a process that is gone."""
    for d in of_run.glob(".incoming-*"):
        pid = d.name.rpartition("-")[2]
        if pid.isdigit() and not store.pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def make_room(root: Path, run: str, *, need: int, budget: int) -> tuple[int, tuple[Path, ...]]:
    """What the tier holds once room is made for ``need`` more bytes of ``run``'s, and the other runs' ring
    copies let go for it (only of runs no live process holds on this host, oldest made first; none when
    the bytes fit already). It may still not fit: the caller decides. Raises OSError (the tier unreadable)."""
    held_now = tier_bytes(root)
    if need + held_now <= budget:
        return held_now, ()
    gone: list[Path] = []
    with _ended_runs(root, run) as ended:
        for copy in sorted((c for d in ended for c in copies(d)), key=_made):
            if need + held_now <= budget:
                break
            nbytes = tier_bytes(copy)
            shutil.rmtree(copy, ignore_errors=True)
            held_now -= nbytes
            gone.append(copy)
        for d in ended:
            sweep(d)
    if gone:
        log.info("memory tier %s: %d ring copies of ended runs let go for %s", root, len(gone), run)
    return tier_bytes(root), tuple(gone)


def record_let_go(cat: Catalog, host: str, gone: tuple[Path, ...] | tuple[str, ...], why: str) -> None:
    """The rows of ring copies ``host`` let go (by their directories), recorded let go."""
    uris = {str(g) for g in gone}
    for h in ring_held_by(cat, host, None) if uris else []:
        if h.uri in uris:
            catalog_copies.record(cat, h.replica_id, R.DELETED, why)


def _made(copy: Path) -> int:
    return (copy / mf.MANIFEST_NAME).stat().st_mtime_ns


@contextlib.contextmanager
def _ended_runs(root: Path, run: str) -> Iterator[list[Path]]:
    """The other runs' directories whose lock this process could take (none of their leaders lives on this
    host), held until the block ends: a leader starting meanwhile waits for it."""
    mine = run_dir(root, run)
    held: list[tuple[Path, int]] = []
    try:
        for d in sorted((root / RING_DIR).glob("*")) if (root / RING_DIR).is_dir() else []:
            if d == mine or d.is_symlink() or not d.is_dir():
                continue
            fd = _try_lock(d)
            if fd is not None:
                held.append((d, fd))
        yield [d for d, _ in held]
    finally:
        for _, fd in held:
            os.close(fd)


def _try_lock(of_run: Path) -> int | None:
    try:
        fd = os.open(of_run / LIVE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a live leader holds it
        os.close(fd)
        return None
    return fd
