"""The peer ring's rules that need no process group: a host keeps the ring copy it just made (after a roll
back too), a received file is kept only when it is its manifest entry, a recovery counts on a lost host's
share only while a surviving host's memory holds it, and a memory tier that is not this user's own is
never read. (Passing shares between ranks, and restoring from them: tests/test_spread.py, tests/test_slurm.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from rewind.infra.checkpoint import ring, ring_held, ring_wire
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_bytes
from rewind.infra.phases.restore import _on_other_hosts
from rewind.infra.restore import plan


def _copy(run_dir: Path, name: str) -> Path:
    d = run_dir / name
    d.mkdir(parents=True)
    (d / mf.MANIFEST_NAME).write_bytes(b"{}")
    return d


def test_the_copy_just_made_is_kept_even_when_an_older_one_has_a_higher_step(tmp_path: Path) -> None:
    """After a roll back to step 100, step 110's copy is the newest: the abandoned step 200's goes."""
    abandoned = _copy(tmp_path, "step-200-aaaa")
    past = time.time() - 60
    os.utime(abandoned / mf.MANIFEST_NAME, (past, past))
    kept = _copy(tmp_path, "step-110-bbbb")
    ring._let_go(kept, keep=1)
    assert kept.exists() and not abandoned.exists()


def _entry(raw: bytes, path: str = "__1_0.distcp") -> mf.FileEntry:
    d = hash_bytes(raw)
    return mf.FileEntry(path=path, size=d.size, xxh3=d.xxh3, crc32c=d.crc32c)


@pytest.mark.parametrize("damaged", [False, True])
def test_a_received_file_is_kept_only_when_its_pieces_are_its_entry(tmp_path: Path, damaged: bool) -> None:
    raw = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and a bit: two pieces at a 512 KiB piece size
    entry = _entry(raw)
    writer = ring_wire.Writer(tmp_path)
    size = 512 * 1024
    got = bytearray(raw)
    if damaged:
        got[-1] ^= 1
    for off in range(0, len(got), size):
        piece = ring_wire.Piece(entry, off, min(size, len(got) - off))
        writer.take(piece, torch.frombuffer(bytearray(got[off : off + piece.length]), dtype=torch.uint8))
    assert (writer.kept, bool(writer.errors)) == ((0, True) if damaged else (len(raw), False)), writer.errors
    if not damaged:
        assert (tmp_path / entry.path).read_bytes() == raw


def _plan(ring_copies: tuple[tuple[str, str], ...]) -> plan.RestorePlan:
    c = plan.Candidate(7, "run", 20, "committed", "d" * 64, 100, (), ("h1", "h2"), ring_copies)
    return plan.RestorePlan("run", Path("/nonexistent"), (c,), False)


def test_a_recovery_counts_on_a_lost_hosts_share_only_while_a_surviving_host_holds_it() -> None:
    assert _on_other_hosts(_plan(()), {"h2"}) is None  # h2's share is nowhere else
    assert _on_other_hosts(_plan((("h1", "h2"), ("h2", "h1"))), {"h2"}) is not None  # in h1's memory
    assert _on_other_hosts(_plan((("h2", "h1"),)), {"h2"}) is None  # only in h2's own: gone with it
    assert _on_other_hosts(_plan((("h1", "h2"),)), {"h1", "h2"}) is None  # its holder lost too


def test_ring_copies_in_a_memory_tier_that_is_a_link_are_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "someone-elses"
    copy = _copy(elsewhere / ".ring" / "run", "step-1-aaaa")
    (copy / mf.MANIFEST_NAME).write_bytes(b"manifest")
    raw = b"a file that proves itself"
    (copy / "__1_0.distcp").write_bytes(raw)
    manifest = mf.Manifest(run="run", step=1, files=(_entry(raw),))
    monkeypatch.setenv("REWIND_MEMORY_ROOT", str(elsewhere))
    assert set(ring_held.held(b"manifest", manifest).files) == {
        "__1_0.distcp"
    }  # read where it is this user's own
    link = tmp_path / "memory"
    link.symlink_to(elsewhere)
    monkeypatch.setenv("REWIND_MEMORY_ROOT", str(link))
    assert ring_held.held(b"manifest", manifest).files == {}  # never through a link


def test_a_rebooted_hosts_ring_copies_are_let_go_in_the_catalog_at_the_next_pass(
    rewind_env, run_name: str, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Host h1 held h2's share of step 1; it rebooted (its memory tier has a new mark, the old copy is
    gone) and now holds step 2's: step 1's ring row is let go, step 2's recorded, whatever the marks."""
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.format.local_tier import LocalTier

    cat = Catalog()
    ck = Checkpointer(run_name, states={"model": torch.nn.Linear(4, 4)}, root=tmp_path / "ckpt", catalog=cat)
    ids = []
    for step in (1, 2):
        ck.save(step)
        assert ck.last_saved is not None
        ids.append(ck.last_saved.checkpoint_id)
    for ck_id, mark in zip(ids, ("mark-before-reboot", "mark-after-reboot"), strict=True):
        passed = ring.Passed(10, 10, tmp_path / f"ring-{ck_id}", LocalTier(mark, "h1"), "h2")
        ring.register(cat, ck_id, run_name, [passed])
    rows = {
        (c.step, r.key, r.status)
        for c in lineage.checkpoints(cat, run_name)
        for r in lineage.replicas_of(cat, c.id)
        if r.tier == "memory"
    }
    assert rows == {(1, "ring:h2", "deleted"), (2, "ring:h2", "verified")}, rows


def test_a_leader_that_cannot_read_its_copy_says_why_and_never_raises(tmp_path: Path) -> None:
    from rewind.infra.checkpoint.spread import Disks
    from rewind.infra.format.local_tier import LocalTier

    disks = Disks((LocalTier("a", "h1"), LocalTier("b", "h2")))
    why = ring._ready(tmp_path / "no-such-step", "run", disks, 1, 0)
    assert isinstance(why, ring.Refused) and "cannot be read" in why.why


_FILES = {
    "__0_0.distcp": (b"a" * 300, "a"),
    "__1_0.distcp": (b"b" * 400, "b"),
    ".metadata": (b"m" * 100, None),
}


def _placed(step: int) -> mf.Manifest:
    """Host h1's disk a holds 300 bytes of its own and 100 every disk holds; h2's share is 400 bytes."""
    entries = tuple(_entry(raw, path) for path, (raw, _) in _FILES.items())
    placement = {path: disk for path, (_, disk) in _FILES.items() if disk}
    return mf.Manifest("run", step, entries, placement=placement, disks={"a": "h1", "b": "h2"})


def _committed(where: Path, manifest: mf.Manifest, files: tuple[str, ...] = ()) -> Path:
    where.mkdir(parents=True)
    for name in files:
        (where / name).write_bytes(_FILES[name][0])
    (where / mf.MANIFEST_NAME).write_bytes(manifest.to_bytes())  # last, as a pass writes it
    return where


@pytest.mark.parametrize(
    ("budget", "own", "kept"),
    [(1 << 20, True, True), (1 << 20, False, False), (700, True, False)],
    ids=["both-fit", "sync-save", "peer-share-only-fits"],
)
def test_a_leader_keeps_its_own_files_only_beside_its_peers_share_and_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int, own: bool, kept: bool
) -> None:
    """Host h1's leader (rank 0) takes h2's 400-byte share; its own disk's files are kept too when asked (a
    background pass) and the budget holds them beside the peer's share; else the peer's share alone, never
    refused for them."""
    from rewind.infra.checkpoint.spread import Disks
    from rewind.infra.format.local_tier import LocalTier

    disks = Disks((LocalTier("a", "h1"), LocalTier("b", "h2")))
    step = _committed(tmp_path / "disk" / "step-1", _placed(1))
    monkeypatch.setenv("REWIND_MEMORY_ROOT", str(tmp_path / "memory"))
    monkeypatch.setenv("REWIND_MEMORY_BUDGET", str(budget))
    ready = ring._ready(step, "run", disks, 1, 0, own=own)
    assert isinstance(ready, ring.Ready), ready
    got = None if ready.own is None else {e.path for e in ready.own}
    assert got == ({"__0_0.distcp", ".metadata"} if kept else None), got


def test_a_hosts_own_files_in_an_older_copy_make_room_for_the_next_peer_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1's copy holds h2's share (400 bytes) and h1's own files (400); the budget is 100 bytes above what
    the tier holds: step 2's share fits only if those own files go (h1's disk holds them); they are chosen,
    never the peer's share, and step 2's own files do not fit as well."""
    from rewind.infra.checkpoint.spread import Disks
    from rewind.infra.format.local_tier import LocalTier
    from rewind.infra.memory import keeper, place, ring_room

    disks = Disks((LocalTier("a", "h1"), LocalTier("b", "h2")))
    monkeypatch.setenv("REWIND_MEMORY_ROOT", str(tmp_path / "memory"))
    older = _committed(tmp_path / "memory" / ".ring" / "run" / "step-1-0001", _placed(1), tuple(_FILES))
    cfg = place.config()
    assert cfg is not None
    keeper.mark(cfg)
    monkeypatch.setenv("REWIND_MEMORY_BUDGET", str(ring_room.tier_bytes(cfg.root) + 100))
    step = _committed(tmp_path / "disk" / "step-2", _placed(2))
    ready = ring._ready(step, "run", disks, 1, 0, own=True)
    assert isinstance(ready, ring.Ready), ready
    assert set(ready.reclaim) == {older / "__0_0.distcp", older / ".metadata"}, ready.reclaim
    assert ready.own is None  # 400 + 400 left: no room for step 2's own files as well


def _ring_copy(root: Path, run: str, step: int, nbytes: int, made: float) -> Path:
    d = root / ".ring" / run / f"step-{step}-{step:016x}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * nbytes)
    (d / mf.MANIFEST_NAME).write_bytes(b"")  # its bytes are the file's alone
    os.utime(d / mf.MANIFEST_NAME, (made, made))
    return d


def test_a_pass_lets_go_of_ended_runs_ring_copies_closed_first_then_oldest_never_a_live_runs(
    tmp_path: Path,
) -> None:
    """Runs 'closed' (its leader closed: '.closed') and 'failed' (its leader died) ended on this host; 'live'
    has a leader alive (another process holding its lock). A shortfall of 150 bytes: the closed run's copy
    goes before the failed run's older ones, then the failed run's oldest; only as many as cover it. A
    shortfall the ended runs' copies cannot cover lets nothing go; the live run's never goes, until its
    leader dies."""
    import subprocess
    import sys

    from rewind.infra.memory import ring_room

    now = time.time()
    live = _ring_copy(tmp_path, "live", 1, 100, now - 400)  # the oldest of all, but its run lives
    older = _ring_copy(tmp_path, "failed", 1, 100, now - 300)
    newer = _ring_copy(tmp_path, "failed", 2, 100, now - 200)
    closed = _ring_copy(tmp_path, "closed", 3, 100, now - 100)
    (closed.parent / ring_room.CLOSED).touch()
    code = "import sys; from pathlib import Path; from rewind.infra.memory import ring_room as r; " \
        "h = r.Live(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"  # fmt: skip
    leader = subprocess.Popen(
        [sys.executable, "-c", code, str(live.parent)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "held"
        too_much = ring_room.choose(tmp_path, "new", 301)  # the ended runs hold 300: nothing goes
        assert too_much.victims == [] and too_much.nbytes == 0
        chosen = ring_room.choose(tmp_path, "new", 150)
        assert chosen.victims == [closed, older] and chosen.nbytes == 200
        assert chosen.commit() == (str(closed), str(older))
        assert not closed.exists() and not older.exists() and newer.exists() and live.exists()
    finally:
        leader.kill()
        leader.wait(timeout=30)
    chosen = ring_room.choose(tmp_path, "new", 200)  # its leader is gone: the live run has ended too
    assert chosen.victims == [live, newer]
    chosen.release()
    assert live.exists()  # released, not committed: nothing let go


def test_a_leader_starting_while_another_run_chooses_waits_for_it_and_then_holds(tmp_path: Path) -> None:
    """While an eviction holds an ended run's lock, that run's relaunched leader cannot take its hold; once
    the eviction is released it does, and the run's copies can no longer be chosen."""
    from rewind.infra.memory import ring_room

    copy = _ring_copy(tmp_path, "run", 1, 100, time.time())
    chosen = ring_room.choose(tmp_path, "other", 50)
    assert chosen.victims == [copy]
    held_off = ring_room.HOLD_WAIT_S
    ring_room.HOLD_WAIT_S = 0.2
    try:
        with pytest.raises(OSError, match="held by another process"):
            ring_room.Live(copy.parent)
    finally:
        ring_room.HOLD_WAIT_S = held_off
    chosen.release()
    live = ring_room.Live(copy.parent)
    try:
        assert ring_room.choose(tmp_path, "other", 50).victims == []
    finally:
        live.close()
    assert (copy.parent / ring_room.CLOSED).exists()  # closed here: its copies are the first to go


def test_ring_copies_let_go_for_another_runs_room_are_let_go_in_the_catalog(
    rewind_env, run_name: str, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Host h1 held h2's share of the ended run's step 1; a pass of another run let it go to make room:
    its row is recorded let go, the other host's copy of the same run stays."""
    from rewind.infra.catalog import lineage
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.format.local_tier import LocalTier

    cat = Catalog()
    ck = Checkpointer(run_name, states={"model": torch.nn.Linear(4, 4)}, root=tmp_path / "ckpt", catalog=cat)
    ck.save(1)
    assert ck.last_saved is not None
    ended = ck.last_saved.checkpoint_id
    on_h1, on_h2 = tmp_path / "h1-ring", tmp_path / "h2-ring"
    ring.register(cat, ended, run_name, [ring.Passed(10, 10, on_h1, LocalTier("m1", "h1"), "h2"),
                                         ring.Passed(10, 10, on_h2, LocalTier("m2", "h2"), "h1")])  # fmt: skip
    other = ring.Passed(0, 0, None, LocalTier("m1", "h1"), evicted=(str(on_h1),))
    ring.register(cat, ended, "another-run", [other])
    rows = {(r.host, r.status) for r in lineage.replicas_of(cat, ended) if r.tier == "memory"}
    assert rows == {("h1", "deleted"), ("h2", "verified")}, rows


def _memory_copy(tmp_path: Path, manifest: mf.Manifest) -> Path:
    return _committed(tmp_path / "memory" / ".ring" / "run" / "step-1-0001", manifest, tuple(_FILES))


@pytest.mark.parametrize("damage", ["own-file", "peer-file"])
def test_a_damaged_own_file_is_dropped_alone_and_a_damaged_peer_file_refuses_the_copy(
    tmp_path: Path, damage: str
) -> None:
    """Host h1's disk a lacks every file (a fresh disk); its memory's ring copy holds h2's share and h1's own
    files. One of h1's own files damaged: that file alone is dropped (its disk's copy serves it), h2's share
    is taken. A file of h2's share of another size: the copy is refused and removed, nothing taken from it."""
    from rewind.infra.checkpoint import assemble

    manifest = _placed(1)
    copy = _memory_copy(tmp_path, manifest)
    victim = "__0_0.distcp" if damage == "own-file" else "__1_0.distcp"
    if damage == "own-file":
        (copy / victim).write_bytes(b"A" + _FILES[victim][0][1:])  # the right size, not the right bytes
    else:
        (copy / victim).write_bytes(_FILES[victim][0] + b"!")  # another size: found when listed
    found = ring_held.Found(*_listed(copy, manifest))
    target = tmp_path / "disk"
    target.mkdir()
    taken, refused, dropped = assemble._take(target, manifest, found, set(), "a")
    if damage == "own-file":
        assert refused == () and victim in dropped and not (copy / victim).exists(), (refused, dropped)
        assert set(taken) == {"__1_0.distcp", ".metadata"} and (copy / "__1_0.distcp").exists()
    else:
        assert refused == (str(copy),) and taken == {} and not copy.exists(), (refused, taken)


def _listed(copy: Path, manifest: mf.Manifest) -> tuple[dict[str, Path], str, dict[str, Path]]:
    present, odd = ring_held._present(copy, manifest)
    return present, "tier", odd
