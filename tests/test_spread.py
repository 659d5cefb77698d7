"""A checkpoint spread over hosts' own disks (4 ranks, 2 per disk, on one machine; gloo): each disk holds
its ranks' files and what every rank reads, the catalog names both copies, each copy verifies as its
disk's share; a restore on the same disks reads every byte from the disks (the other disk's share sent
over the process group), bit-exact; with one disk gone and nothing else holding its share, the job
refuses to start over."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rewind.infra.catalog import copies, lineage, moved_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, ReplicaStatus
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.format import local_tier
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import manifest_digest
from rewind.infra.format.local_tier import LocalTier
from rewind.infra.format.verify import Verdict, check_copy, partial
from tests.spread_worker import RUN
from tests.torchrun_support import torchrun

REPO = Path(__file__).resolve().parents[1]


def _job(
    mode: str,
    work: Path,
    layout: str,
    *,
    ok: bool = True,
    shared: Path | None = None,
    ring: bool = False,
    sync: bool = False,
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("REWIND_SHARED_URI", None)
    if ring:  # each host its memory, async saves (``sync``: sync ones): the ring on by default (unset)
        env |= {"REWIND_TEST_RING": "1", **({} if sync else {"REWIND_TEST_ASYNC": "1"})}
        env.pop("REWIND_MEMORY_RING", None)
    if ring and sync and mode == "save":  # rank 2's first pass held: the save returns, the next one waits
        env |= {"REWIND_FAULT": "hold:ring.pass@1%2", "REWIND_FAULT_RELEASE": str(work / "release")}
    if shared is not None:
        env["REWIND_SHARED_URI"] = str(shared)
    r = subprocess.run(
        [*torchrun(4), "-m", "tests.spread_worker", mode, str(work), layout],
        cwd=REPO, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert (r.returncode == 0) == ok, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _checked(work: Path, disk: str) -> object:
    """When the catalog last recorded disk ``disk``'s copy of step 2 checked."""
    mark = local_tier.read(work / "disks" / disk)
    assert mark
    (ck,) = lineage.checkpoints(Catalog(f"sqlite:///{work / 'catalog.db'}"), RUN, step=2)
    (row,) = [
        r
        for r in lineage.replicas_of(Catalog(f"sqlite:///{work / 'catalog.db'}"), ck.id)
        if r.tier_id == mark.id
    ]
    return row.checked_at


def _equal(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """Steps 1 and 2 saved by ranks 0-1 on disk a and 2-3 on disk b (the catalog names each copy by its
    path: every test saves its own)."""
    _job("save", tmp_path, "a,a,b,b")
    return tmp_path


def _shares(saved: Path) -> None:
    a, b = (saved / "disks" / d / RUN / "step-2" for d in "ab")
    ma = mf.read(a)
    assert mf.parse((b / mf.MANIFEST_NAME).read_bytes()) == ma  # one manifest, on both disks
    disk_a, disk_b = local_tier.read(a.parent.parent), local_tier.read(b.parent.parent)
    assert disk_a and disk_b and disk_a.id != disk_b.id
    own_a = {"rank-0.json", "rank-1.json"} | {f"__{r}_0.distcp" for r in (0, 1)}
    own_b = {"rank-2.json", "rank-3.json"} | {f"__{r}_0.distcp" for r in (2, 3)}
    assert {p for p, d in ma.placement.items() if d == disk_a.id} <= own_a
    assert {p for p, d in ma.placement.items() if d == disk_b.id} <= own_b
    assert {"rank-2.json", "rank-3.json"} <= set(ma.placement) and ma.disks[disk_b.id] == disk_b.host
    listed_a = {p.name for p in a.iterdir()}
    assert not listed_a & own_b and {"rank-2.json", "rank-3.json"} <= {p.name for p in b.iterdir()}
    assert {".metadata", "state.json"} <= listed_a & {p.name for p in b.iterdir()}
    for copy in (a, b):  # a share is whole for its disk: not missing the other disk's files
        report = check_copy(copy, None, deep=True)
        assert report.verdict is Verdict.VERIFIED, report.findings
    cat = Catalog(f"sqlite:///{saved / 'catalog.db'}")
    (ck,) = lineage.checkpoints(cat, RUN, step=2)
    rows = [r for r in lineage.replicas_of(cat, ck.id) if r.tier == "local"]
    assert sorted(r.tier_id for r in rows) == sorted([disk_a.id, disk_b.id]), rows
    assert sum(r.bytes for r in rows) > ma.total_bytes  # each row: its share, the shared files on both


def test_each_disk_holds_its_share_and_a_restore_on_the_same_disks_reads_every_byte_from_them(
    saved: Path,
) -> None:
    _shares(saved)
    work = saved
    before = _checked(work, "a")
    _job("load", work, "a,a,b,b")
    assert _checked(work, "a") != before  # every byte of disk a's copy hashed by the load: recorded checked
    assert _equal(work / "loaded.safetensors", saved / "expected.safetensors")
    got = json.loads((work / "sources.json").read_text())
    total = mf.read(work / "disks" / "a" / RUN / "step-2").total_bytes
    assert got["step"] == 2 and len(got["disks"]) == 2, got
    for d in got["disks"]:  # each disk: its own share read in place, the other's sent by its ranks
        assert d["local"] + d["peer"] == total and 0 < d["peer"] < total, got
    for d in "ab":  # and now each disk holds a whole copy
        copy = work / "disks" / d / RUN / "step-2"
        assert check_copy(copy, None, deep=True).verdict is Verdict.VERIFIED and not partial(
            copy, mf.read(copy)
        )


def test_a_step_saved_again_on_another_timeline_moves_every_disks_old_copy_aside(saved: Path) -> None:
    """The job saves steps 1 and 2 again (a timeline replayed after a roll back): every disk's copy of the old
    checkpoints is moved aside (not only rank 0's), their catalog rows follow them there, the new ones
    commit on both disks and restore bit-exact."""
    work = saved
    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    (old,) = lineage.checkpoints(cat, RUN, step=2)
    _job("save", work, "a,a,b,b")
    by_status = {c.status: c for c in lineage.checkpoints(cat, RUN, step=2)}
    assert set(by_status) == {"superseded", "committed"}, by_status
    new = by_status["committed"]
    assert by_status["superseded"].id == old.id and new.manifest_digest != old.manifest_digest
    for ck in (old, new):
        rows = [r for r in lineage.replicas_of(cat, ck.id) if r.tier == "local"]
        assert len(rows) == 2, rows  # one copy on each disk, each row naming the bytes it describes
        for r in rows:
            assert ("/.quarantine/" in r.uri) == (ck is old), r.uri
            assert manifest_digest((Path(r.uri) / mf.MANIFEST_NAME).read_bytes()) == ck.manifest_digest, r.uri
    _job("load", work, "a,a,b,b")
    assert json.loads((work / "sources.json").read_text())["step"] == 2
    assert _equal(work / "loaded.safetensors", work / "expected.safetensors")


def _saved_again_failing(
    work: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Catalog, Checkpoint]:
    """Steps 1-2 saved again with ``fault`` (``REWIND_FAULT``) failing the job at step 2: the catalog, and the
    old step 2's row, still the step's committed checkpoint."""
    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    (old,) = lineage.checkpoints(cat, RUN, step=2)
    monkeypatch.setenv("REWIND_FAULT", fault)
    _job("save", work, "a,a,b,b", ok=False)
    monkeypatch.delenv("REWIND_FAULT")
    assert [c.status for c in lineage.checkpoints(cat, RUN, step=2) if c.id == old.id] == ["committed"]
    return cat, old


def test_a_step_saved_again_that_fails_at_rank_0_leaves_every_disks_old_copy_restorable(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 saved again, disk b's copy renamed in (its old one moved aside), then rank 0's own commit fails:
    every disk's old copy is back where it was and its rows with it, and the old step 2 restores bit-exact
    (before, disk b's old copy stayed aside and the restore fell back to step 1)."""
    work = saved
    cat, old = _saved_again_failing(work, "eio:save.before_rename@2%0", monkeypatch)
    for r in (r for r in lineage.replicas_of(cat, old.id) if r.tier == "local"):
        assert "/.quarantine/" not in r.uri and Path(r.uri).name == "step-2", r.uri
        assert manifest_digest((Path(r.uri) / mf.MANIFEST_NAME).read_bytes()) == old.manifest_digest, r.uri
    _job("load", work, "a,a,b,b")
    assert json.loads((work / "sources.json").read_text())["step"] == 2
    assert _equal(work / "loaded.safetensors", work / "expected.safetensors")


def test_rank_0_killed_after_another_disk_committed_a_step_saved_again_leaves_the_old_step_restorable(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 saved again: disk b's copy renamed in (its old one moved aside, its row with it), then rank 0 is
    SIGKILLed before its own rename, so no disk hears the outcome and disk b's old copy stays aside. The old
    step 2 is still the newest committed checkpoint: its restore puts disk b's copy back from beside it (its
    row following) and loads it bit-exact (before, disk b's share was nowhere the restore looked, and the
    restore fell back to step 1: step 2's progress lost)."""
    work = saved
    cat, old = _saved_again_failing(work, "kill:save.before_rename@2%0", monkeypatch)
    _job("load", work, "a,a,b,b")
    assert json.loads((work / "sources.json").read_text())["step"] == 2
    assert _equal(work / "loaded.safetensors", work / "expected.safetensors")
    for r in (r for r in lineage.replicas_of(cat, old.id) if r.tier == "local"):  # the rows name the copies
        assert r.status != ReplicaStatus.DELETED.value and Path(r.uri).name == "step-2", r.uri
        assert manifest_digest((Path(r.uri) / mf.MANIFEST_NAME).read_bytes()) == old.manifest_digest, r.uri


def test_a_disk_holding_another_checkpoint_at_the_step_a_restore_completes_moves_it_and_its_rows_aside(
    saved: Path,
) -> None:
    """Host b was away while the run saved steps 1-2 again on host a alone (another timeline): when b comes
    back, its disk still holds the old step 2. The restore completes b's copy of the new step 2 there, moving
    the old one aside, and the old checkpoint's row on b follows it (it would name the new bytes)."""
    work = saved
    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    (old,) = lineage.checkpoints(cat, RUN, step=2)
    _job("save", work, "a,a,a,a")
    _job("load", work, "a,a,b,b")
    assert _equal(work / "loaded.safetensors", work / "expected.safetensors")
    new = next(c for c in lineage.checkpoints(cat, RUN, step=2) if c.id != old.id)
    disk_b = local_tier.read(work / "disks" / "b")
    assert disk_b is not None
    (row,) = [r for r in lineage.replicas_of(cat, old.id) if r.tier_id == disk_b.id]
    assert "/.quarantine/" in row.uri, row.uri
    assert manifest_digest((Path(row.uri) / mf.MANIFEST_NAME).read_bytes()) == old.manifest_digest
    b_step = work / "disks" / "b" / RUN / "step-2"
    assert manifest_digest((b_step / mf.MANIFEST_NAME).read_bytes()) == new.manifest_digest


def test_a_disk_copy_left_with_its_manifest_alone_is_made_again_from_the_peers_and_the_shared_tier(
    tmp_path: Path,
) -> None:
    """Disk b's copy of step 2 lost every file but its manifest (an operator's cleanup, a disk that lost
    blocks): the restore moves it aside and makes b's copy again (b's share from the shared tier, the rest
    from a's ranks), and loads step 2 bit-exact."""
    work, shared = tmp_path, tmp_path / "shared"
    shared.mkdir()
    _job("save", work, "a,a,b,b", shared=shared)
    b_step = work / "disks" / "b" / RUN / "step-2"
    for p in b_step.iterdir():
        if p.name != mf.MANIFEST_NAME:
            p.unlink()
    _job("load", work, "a,a,b,b", shared=shared)
    got = json.loads((work / "sources.json").read_text())
    assert got["step"] == 2 and got["disks"][1]["local"] == 0, got
    assert _equal(work / "loaded.safetensors", work / "expected.safetensors")
    assert check_copy(b_step, None, deep=True).verdict is Verdict.VERIFIED
    cat, disk_b = Catalog(f"sqlite:///{work / 'catalog.db'}"), local_tier.read(work / "disks" / "b")
    (ck,) = lineage.checkpoints(cat, RUN, step=2)
    (row,) = [r for r in lineage.replicas_of(cat, ck.id) if disk_b and r.tier_id == disk_b.id]
    assert row.uri == str(b_step), row.uri  # the restored checkpoint's row stays with the copy made again


def test_rows_of_another_hosts_disk_follow_its_copy_by_the_disks_id_not_the_path(
    rewind_env, run_name, tmp_path
):  # type: ignore[no-untyped-def]
    """Node-local disks share paths: rank 0 moving (or letting go) the rows of host h2's copy at a path must
    touch h2's rows alone, never h1's copy at the same path, nor one on the disk rank 0 itself sees."""
    cat = Catalog()
    root = tmp_path / "ckpt"
    Checkpointer(run_name, states={"model": torch.nn.Linear(4, 4)}, root=root, catalog=cat).save(10)
    (ck,) = lineage.checkpoints(cat, run_name, 10)
    path = f"/nvme/{run_name}/step-10"
    for host in ("h1", "h2", "h3"):
        copies.add(cat, ck.id, "local", path, key=None, nbytes=1, status=ReplicaStatus.VERIFIED,
                   disk=LocalTier(f"disk-{host}", host))  # fmt: skip
    moves = [(path, f"{path}.aside", LocalTier("disk-h2", "h2")), (path, None, LocalTier("disk-h3", "h3"))]
    moved_copies.followed(cat, moves, "moved")
    rows = {r.host: (r.uri, r.status) for r in lineage.replicas_of(cat, ck.id) if r.uri.startswith("/nvme")}
    assert rows == {"h1": (path, "verified"), "h2": (f"{path}.aside", "verified"), "h3": (path, "deleted")}


def test_with_a_disk_gone_and_no_other_copy_the_job_refuses_to_start_over(saved: Path) -> None:
    work = saved
    shutil.rmtree(work / "disks" / "b")  # host b and its disk are gone: ranks 2-3 come back on a spare, c
    _job("load", work, "a,a,c,c", ok=False)
    refused = (work / "refused.txt").read_text()
    assert "refusing to start over" in refused and "no disk at hand" in refused, refused
    assert not (work / "loaded.safetensors").exists()


def test_each_host_sends_its_share_to_the_shared_tier_and_a_lost_disks_files_come_from_there(
    tmp_path: Path,
) -> None:
    """Saved with a shared tier: each disk's leader sends its own files, the last one the manifest; the
    shared copy is registered verified. With disk b gone, ranks 2-3 come back on a spare disk c: disk a's
    share is read in place, disk b's files are fetched from the shared tier (only those), and disk c gets
    everything from its peers; bit-exact."""
    shared = tmp_path / "shared"
    shared.mkdir()
    _job("save", tmp_path, "a,a,b,b", shared=shared)
    a = tmp_path / "disks" / "a" / RUN / "step-2"
    ma = mf.read(a)
    copy = shared / RUN / "step-2"
    assert (copy / mf.MANIFEST_NAME).read_bytes() == (a / mf.MANIFEST_NAME).read_bytes()
    assert check_copy(copy, None, deep=True).verdict is Verdict.VERIFIED and not partial(copy, ma)
    cat = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    (ck,) = lineage.checkpoints(cat, RUN, step=2)
    rows = [r for r in lineage.replicas_of(cat, ck.id) if r.tier == "shared"]
    assert [(r.status, r.key) for r in rows] == [("verified", f"{RUN}/step-2")], rows

    shutil.rmtree(tmp_path / "disks" / "b")  # host b and its disk are gone
    _job("load", tmp_path, "a,a,c,c")
    assert _equal(tmp_path / "loaded.safetensors", tmp_path / "expected.safetensors")
    got = json.loads((tmp_path / "sources.json").read_text())
    disk_a = local_tier.read(tmp_path / "disks" / "a")
    assert disk_a
    share_b = sum(e.size for e in ma.files if ma.placement.get(e.path) not in (None, disk_a.id))
    a_got, c_got = got["disks"]  # by disk leader: rank 0 (disk a), rank 2 (disk c)
    assert got["step"] == 2 and a_got["remote"] == share_b and a_got["local"] == ma.total_bytes - share_b, got
    assert c_got == {**c_got, "local": 0, "peer": ma.total_bytes, "remote": 0}, got


def test_files_another_timeline_left_on_the_shared_tier_never_complete_a_copy(saved: Path) -> None:
    """A push cut short left files of the right sizes under the step's name (another checkpoint's bytes,
    no manifest). Disk a's share alone must not make the copy whole: only a mark from every disk, naming
    this checkpoint's digest, does; then disk b's push replaces what does not prove to be its files."""
    from rewind.infra.checkpoint import share_push
    from rewind.infra.format import keyring as kr
    from rewind.infra.tiers import open_tier
    from rewind.infra.tiers.transfer import check_remote

    shared = saved / "shared"
    a, b = (saved / "disks" / d / RUN / "step-2" for d in "ab")
    disk_a, disk_b = (local_tier.read(saved / "disks" / d) for d in "ab")
    assert disk_a and disk_b
    ma = mf.read(a)
    stale = shared / RUN / "step-2"
    stale.mkdir(parents=True)
    for e in ma.files:
        if ma.placement.get(e.path) == disk_b.id:
            (stale / e.path).write_bytes(b"\0" * e.size)  # the right size, not the right bytes
    tier = open_tier(str(shared))
    first = share_push.push(share_push.Share(RUN, 2, a, disk_a.id, with_common=True), tier, None)
    assert not first.complete and not (stale / mf.MANIFEST_NAME).exists(), first
    second = share_push.push(share_push.Share(RUN, 2, b, disk_b.id, with_common=False), tier, None)
    assert second.complete and second.sent > 0, second
    (ck,) = lineage.checkpoints(Catalog(f"sqlite:///{saved / 'catalog.db'}"), RUN, step=2)
    report = check_remote(tier, f"{RUN}/step-2", str(ck.manifest_digest), deep=True, keyring=kr.from_env())
    assert report.verdict is Verdict.VERIFIED, report.findings


@pytest.fixture
def ringed(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """Steps 1 and 2 saved on disks a and b (async; sync where the test's parameter says so), each host with
    its own memory tier (the peer ring on by default) and a shared tier."""
    (tmp_path / "shared").mkdir()
    for place in ("disks", "memory"):  # each host's disk and memory marked by a host of its own name
        for d in "ab":
            root = tmp_path / place / d
            root.mkdir(parents=True)
            mark = {"id": f"{place}-{d}-{tmp_path.name}", "host": f"host-{d}"}
            (root / local_tier.MARK).write_text(json.dumps(mark), encoding="utf-8")
    sync = getattr(request, "param", "async") == "sync"
    _job("save", tmp_path, "a,a,b,b", shared=tmp_path / "shared", ring=True, sync=sync)
    return tmp_path


def _ring_copy(work: Path, disk: str) -> Path:
    (copy,) = (work / "memory" / disk / ".ring" / RUN).glob("step-*")  # the newest alone: step 1's let go
    return copy


def _share_of(manifest: mf.Manifest, work: Path, disk: str) -> dict[str, int]:
    mark = local_tier.read(work / "disks" / disk)
    assert mark
    return {e.path: e.size for e in manifest.files if manifest.placement.get(e.path) == mark.id}


def test_a_lost_hosts_share_comes_from_the_next_hosts_memory_and_no_other_tier(ringed: Path) -> None:
    """Each host's memory holds the other's share of the newest checkpoint (passed round the ring after the
    commit). With host b, its disk and its memory gone, ranks 2-3 come back on a spare, c: disk a's share
    is read in place, b's taken from a's memory, c gets everything from its peers; nothing is read from the
    shared tier, though it holds a copy; bit-exact."""
    work = ringed
    ma = mf.read(work / "disks" / "a" / RUN / "step-2")
    share_a, share_b = _share_of(ma, work, "a"), _share_of(ma, work, "b")
    whole = {e.path: e.size for e in ma.files}
    for disk, peer in (
        ("a", share_b),
        ("b", share_a),
    ):  # each memory: the peer's files and its own, manifest last
        copy = _ring_copy(work, disk)
        assert copy.name.startswith("step-2-") and (copy / mf.MANIFEST_NAME).read_bytes() == ma.to_bytes()
        held = {p.name: p.stat().st_size for p in copy.iterdir() if p.name != mf.MANIFEST_NAME}
        assert held == whole and peer.items() <= held.items(), (held, peer)  # two hosts: the whole checkpoint

    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    ring_rows = {  # the catalog knows whose share each host's memory holds: a recovery can decide on it
        (ck.step, r.host, r.key, r.status)
        for ck in lineage.checkpoints(cat, RUN)
        for r in lineage.replicas_of(cat, ck.id)
        if r.tier == "memory"
    }
    assert ring_rows == {  # step 1's let go when step 2's were made
        *((step, "host-a", "ring:host-b", status) for step, status in ((1, "deleted"), (2, "verified"))),
        *((step, "host-b", "ring:host-a", status) for step, status in ((1, "deleted"), (2, "verified"))),
    }, ring_rows

    restored_without_host_b(work, ma)


def restored_without_host_b(work: Path, ma: mf.Manifest) -> None:
    """Host b gone with its disk and its memory, ranks 2-3 come back on a spare, c: disk a's share is read in
    place, b's taken from a's memory, c gets everything from its peers; bit-exact."""
    b_bytes = sum(_share_of(ma, work, "b").values())
    shutil.rmtree(work / "disks" / "b")
    shutil.rmtree(work / "memory" / "b")
    _job("load", work, "a,a,c,c", ring=True)
    assert _equal(work / "loaded.safetensors", work / "expected.safetensors")
    a_got, c_got = json.loads((work / "sources.json").read_text())["disks"]
    assert a_got == {**a_got, "local": ma.total_bytes - b_bytes, "memory": b_bytes, "peer": 0, "remote": 0}
    assert c_got == {**c_got, "local": 0, "memory": 0, "peer": ma.total_bytes, "remote": 0}, c_got


@pytest.mark.parametrize("ringed", ["async", "sync"], indirect=True)
def test_a_crash_of_every_rank_reads_each_hosts_files_from_its_own_memory(ringed: Path) -> None:
    """Every rank killed, the hosts and their disks intact: each host's memory holds its own files beside
    its peer's (passed off the job's path: in an async save's persist, after a sync save returned), so the
    loads read every checkpoint byte from memory and none from the disks; bit-exact.
    With a file of host a's own share damaged in its memory, that file alone is read from a's disk (every
    byte is proven as it is read, wherever it is read), and dropped from a's memory alone: b's share there
    stays."""
    work = ringed
    ma = mf.read(work / "disks" / "a" / RUN / "step-2")
    before = _checked(work, "a")
    _job("load", work, "a,a,b,b", ring=True)
    assert _checked(work, "a") == before  # read from memory: disk a's copy not recorded checked for it
    assert _equal(work / "loaded.safetensors", work / "expected.safetensors")
    got = json.loads((work / "sources.json").read_text())
    assert got["loaded"]["disk"] == 0 and got["loaded"]["memory"] > 0, got
    for d in got["disks"]:  # nothing to complete: each disk held its share, the other came from memory
        assert d["local"] + d["memory"] == ma.total_bytes and d["peer"] == d["remote"] == 0, got

    own = _share_of(ma, work, "a")
    victim = next(p for p in sorted(_ring_copy(work, "a").iterdir()) if p.name in own)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    _job("load", work, "a,a,b,b", ring=True)
    assert _equal(work / "loaded.safetensors", work / "expected.safetensors")
    got = json.loads((work / "sources.json").read_text())
    loaded, size = got["loaded"], len(data)
    assert loaded["disk"] > 0 and loaded["disk"] % size == 0 and loaded["memory"] > 0, (size, got)
    copy = _ring_copy(work, "a")  # b's share in a's memory never depends on a's own files
    assert all((copy / name).is_file() for name in _share_of(ma, work, "b")), sorted(copy.iterdir())
    assert not victim.exists()


@pytest.mark.parametrize("shared_left", [True, False], ids=["shared-tier-left", "no-other-copy"])
def test_a_damaged_memory_copy_is_refused_and_the_next_copy_used(ringed: Path, shared_left: bool) -> None:
    """A byte of host a's memory copy of b's share flipped: the copy is refused and removed when the file is
    taken (its catalog row recorded corrupt), and b's files not yet taken come from the shared tier instead;
    bit-exact. With the shared tier
    gone too the restore fails, and the row is recorded corrupt all the same (no recovery counts on it)."""
    work = ringed
    ma = mf.read(work / "disks" / "a" / RUN / "step-2")
    b_bytes = sum(_share_of(ma, work, "b").values())
    copy = _ring_copy(work, "a")
    share_b = _share_of(ma, work, "b")
    victim = next(p for p in sorted(copy.iterdir()) if p.suffix == ".distcp" and p.name in share_b)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    victim_size = len(data)
    shutil.rmtree(work / "disks" / "b")
    shutil.rmtree(work / "memory" / "b")
    if not shared_left:
        shutil.rmtree(work / "shared")
    _job("load", work, "a,a,c,c", ring=True, ok=shared_left)
    if shared_left:
        assert _equal(work / "loaded.safetensors", work / "expected.safetensors")
        a_got, _ = json.loads((work / "sources.json").read_text())["disks"]
        # files taken before the damaged one were proven one by one: the rest, the damaged one first, from S3
        assert a_got["memory"] + a_got["remote"] == b_bytes and a_got["remote"] >= victim_size, a_got
    assert not copy.exists()  # refused and removed: never offered again
    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    (step2,) = lineage.checkpoints(cat, RUN, 2)
    rows = {(r.host, r.status) for r in lineage.replicas_of(cat, step2.id) if r.tier == "memory"}
    assert ("host-a", "corrupt") in rows, rows  # no recovery counts on a's memory for b's share again
