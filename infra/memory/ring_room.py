"""Room in a host's memory tier for the peer ring's copies, and which ones may be let go to make it.

Ring copies live on the memory filesystem, not in a process: they outlive the run that made them. While a
run's leader lives on a host it holds its run's lock there (``Live``: a shared ``flock`` on
``.ring/<run>/.live``, let go by the kernel when the process ends however it ends). When a pass needs
room its budget does not have, other runs' ring copies whose lock nothing holds (their run ended on this
host) may be let go: those of runs that closed first (``.closed``, written at a clean close), then those
of runs that failed (a relaunch may still want them), oldest made first within each, only as many as
cover the shortfall, and none at all when all of them would not cover it. Choosing (``choose``) holds
the chosen runs' locks until the copies are let go (``Eviction.commit``) or kept (``release``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from rewind.infra.catalog import copies as catalog_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.held import held_on
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.format import manifest as mf
from rewind.infra.format import pids

log = logging.getLogger("rewind.ring")
RING_DIR = ".ring"  # no run is named with a leading dot: never a run's memory copy
LIVE = ".live"
CLOSED = ".closed"
HOLD_WAIT_S = 10.0  # a leader starting while another run lets copies go waits at most this long
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
_EVICTING: set[int] = set()  # lock fds an eviction holds: a child forked meanwhile must not keep them


def _close_in_child() -> None:
    for fd in list(_EVICTING):
        with contextlib.suppress(OSError):
            os.close(fd)
    _EVICTING.clear()


os.register_at_fork(after_in_child=_close_in_child)


class Live:
    """A leader's hold on its run's ring copies on this host, for as long as it lives (or until ``close``)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._fd = -1
        self._take()

    def _take(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / CLOSED).unlink(missing_ok=True)
        fd = os.open(self.run_dir / LIVE, _FLAGS, 0o600)
        deadline = time.monotonic() + HOLD_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another run letting copies go holds it for a moment
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise OSError(
                        f"{self.run_dir / LIVE} held by another process for {HOLD_WAIT_S:.0f} s"
                    ) from None
                time.sleep(0.05)
        self._fd = fd

    def renew(self) -> None:
        """Hold the lock file that is there now (a cleanup may have removed the one held)."""
        try:
            held, there = os.fstat(self._fd), os.stat(self.run_dir / LIVE, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
                return
        except OSError:
            pass
        self.close(clean=False)
        self._take()

    def close(self, *, clean: bool = True) -> None:
        """Let go of the hold; ``clean``: the run closed here (its copies are let go before a failed run's)."""
        if self._fd < 0:
            return
        if clean:
            with contextlib.suppress(OSError):
                (self.run_dir / CLOSED).touch()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1


def run_dir(root: Path, run: str) -> Path:
    return root / RING_DIR / mf.safe_relative(run)


def tier_bytes(root: Path) -> int:
    """What this memory tier holds now: every run's copies, the keeper's and the ring's (a file removed
    while it is counted counts nothing)."""
    total = 0
    for p in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            st = p.lstat()
            total += st.st_size if p.is_file() and not p.is_symlink() else 0
    return total


def copies(of_run: Path) -> list[Path]:
    """A run's complete ring copies on this node, newest made first."""
    found = [(d, _made(d)) for d in of_run.glob("step-*-*")]
    return [d for d, made in sorted(found, key=lambda x: x[1], reverse=True) if made >= 0]


def sweep(of_run: Path) -> None:
    """Transfers left unfinished by a process that is gone."""
    for d in of_run.glob(".incoming-*"):
        pid = d.name.rpartition("-")[2]
        if pid.isdigit() and not pids.alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


@dataclass
class Eviction:
    """Ring copies chosen to be let go, their runs' locks held until ``commit`` or ``release``."""

    victims: list[Path] = field(default_factory=list)
    nbytes: int = 0
    _fds: list[int] = field(default_factory=list)

    def commit(self) -> tuple[str, ...]:
        """The chosen copies let go; their directories."""
        try:
            for v in self.victims:
                shutil.rmtree(v, ignore_errors=True)
            if self.victims:
                log.info("%d ring copies of ended runs let go (%d bytes)", len(self.victims), self.nbytes)
            return tuple(str(v) for v in self.victims)
        finally:
            self.release()

    def release(self) -> None:
        for fd in self._fds:
            _EVICTING.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def choose(root: Path, run: str, shortfall: int) -> Eviction:
    """Other runs' ring copies that cover ``shortfall`` bytes (runs that closed first, then failed ones,
    oldest made first), their locks held; nothing chosen when all of them would not cover it."""
    ev = Eviction()
    if shortfall <= 0:
        return ev
    found: list[tuple[bool, int, Path, int]] = []
    try:
        for d in _other_runs(root, run):
            fd = _try_lock(d)
            if fd is None:
                continue
            ev._fds.append(fd)
            sweep(d)
            closed = (d / CLOSED).exists()
            found += [(not closed, _made(c), c, tier_bytes(c)) for c in copies(d)]
    except OSError as exc:  # a tier that cannot be read lets nothing go
        log.warning("memory tier %s: ended runs' ring copies not weighed: %s", root, exc)
        found = []
    if sum(n for *_, n in found) < shortfall:
        ev.release()
        return Eviction()
    for _, _, copy, nbytes in sorted(found, key=lambda x: x[:2]):
        if ev.nbytes >= shortfall:
            break
        ev.victims.append(copy)
        ev.nbytes += nbytes
    return ev


def record(cat: Catalog, tier_id: str, dirs: tuple[str, ...], status: R, why: str) -> None:
    """The rows of the ring copies at ``dirs`` in the memory tier ``tier_id`` recorded ``status`` (let go to
    make room, or refused at a restore)."""
    for h in held_on(cat, catalog_copies.MEMORY, tier_id) if dirs else []:
        if h.ring and h.uri in dirs:
            catalog_copies.record(cat, h.replica_id, status, why)


def _made(copy: Path) -> int:
    """When a ring copy was completed (its manifest written last); -1 for one not complete."""
    try:
        return (copy / mf.MANIFEST_NAME).stat().st_mtime_ns
    except OSError:
        return -1


def _other_runs(root: Path, run: str) -> list[Path]:
    ring = root / RING_DIR
    mine = run_dir(root, run)
    with contextlib.suppress(OSError):
        return [d for d in sorted(ring.iterdir()) if d != mine and d.is_dir() and not d.is_symlink()]
    return []


def _try_lock(of_run: Path) -> int | None:
    try:
        fd = os.open(of_run / LIVE, _FLAGS, 0o600)
    except OSError:
        return None
    _EVICTING.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a live leader holds it
        _EVICTING.discard(fd)
        os.close(fd)
        return None
    return fd
