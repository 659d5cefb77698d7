"""Hostile storage cannot hang the tools, and a full disk is not blamed on the copy that was being read.

Issue 30, item 9: what a tier holds where a manifest names a file is checked before it is read: a FIFO,
a device or a link leading out of the checkpoint directory is refused unopened, and a file claiming more
bytes than its filesystem can hold is judged by that claim, unread. A scrub takes a budget and says what
it left unchecked when the budget is spent. Item 13: a restore whose local write fails (disk full) says
so, naming the local disk, and leaves the copy it was reading from as the catalog had it. Item 11: so
does a replicate onto a full (or read-only) shared path, which registers nothing there.

The command-line tools run as real processes with a bounded wait: on the code before the fix they hung.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rewind import Checkpointer
from rewind.flows.cli import main as rewind
from rewind.infra.catalog import imported, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_bytes, manifest_digest
from rewind.infra.format.verify import Budget, Problem, Verdict
from rewind.infra.replication import replicate
from rewind.infra.restore.scrub import scrub
from rewind.infra.tiers import open_tier
from tests.integrity_support import copy_statuses

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60  # every command here finishes in a few seconds; the code before the fix never did


def _saved(run: str, steps: tuple[int, ...] = (1,), width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    ck = Checkpointer(run=run, states={"model": model})
    try:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(step)
    finally:
        ck.close()
    return model


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """The ``rewind`` command as a real process; a hang fails the test after ``WAIT_S`` (the process is killed)."""
    return subprocess.run(
        [sys.executable, "-m", "rewind.flows.cli", *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def _edit_manifest(directory: Path, edit) -> bytes:  # type: ignore[no-untyped-def]
    """Rewrite a copy's (unsigned) manifest behind Rewind's back, as hostile storage would; its new bytes."""
    body = json.loads((directory / mf.MANIFEST_NAME).read_bytes())
    edit(body["files"])
    raw = json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"
    (directory / mf.MANIFEST_NAME).write_bytes(raw)
    return raw


def _list_empty_file(directory: Path, name: str) -> bytes:
    d = hash_bytes(b"")
    return _edit_manifest(directory, lambda files: files.append({"path": name, **d.as_dict()}))


def _not_imported(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("not imported")]


# -- item 9: file types -----------------------------------------------------------------------------


def test_catalog_rebuild_never_opens_a_fifo_a_manifest_lists(rewind_env, run_name, tmp_path):
    """A FIFO listed as a 0-byte file, on the local and on the shared tier: every rebuild (deep and quick)
    finishes and refuses the copy in one line; the old code hung opening it (deep) or imported it (quick)."""
    root, shared = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "shared"
    _saved(run_name)
    cat = Catalog()
    tier = open_tier(str(shared))
    tier.check()
    replicate(cat, lineage.checkpoints(cat, run_name, 1)[0], tier)
    for where in (root / run_name / "step-1", shared / run_name / "step-1"):
        os.mkfifo(where / "extra.bin")
        _list_empty_file(where, "extra.bin")

    for n, (source, quick) in enumerate(
        [(root, []), (root, ["--quick"]), (shared, []), (shared, ["--quick"])]
    ):
        fresh = f"sqlite:///{tmp_path / f'fresh-{n}.db'}"
        started = time.monotonic()
        got = _cli(["catalog", "rebuild", "--from", str(source), *quick], REWIND_CATALOG_URL=fresh)
        assert time.monotonic() - started < WAIT_S
        assert got.returncode == 1, (source, quick, got.stdout, got.stderr)
        (line,) = _not_imported(got.stdout)
        assert f"{run_name}/step-1" in line and "extra.bin" in line and "FIFO" in line, line
        assert "0 copies placed, 1 not imported" in got.stdout


def test_a_link_out_of_the_checkpoint_directory_is_not_followed(rewind_env, run_name, tmp_path):
    """A data file replaced by a link to a file with the very same bytes elsewhere: refused, never read
    through (the old code followed the link and imported the copy)."""
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    _saved(run_name)
    where = root / run_name / "step-1"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(where / "state.json", outside / "state.json")
    os.symlink(outside / "state.json", where / "state.json")

    for quick in ([], ["--quick"]):
        got = _cli(
            ["catalog", "rebuild", "--from", str(root), *quick],
            REWIND_CATALOG_URL=f"sqlite:///{tmp_path / f'fresh{len(quick)}.db'}",
        )
        assert got.returncode == 1, (got.stdout, got.stderr)
        (line,) = _not_imported(got.stdout)
        assert "state.json" in line and "link" in line and "out of" in line, line


# -- item 9: sizes against the filesystem's --------------------------------------------------------


def _sparse_shard(directory: Path) -> int:
    """The model's shard replaced by a sparse file larger than its filesystem, and the manifest made to
    agree (an unsigned manifest: no key is configured); the size it claims."""
    shard = directory / "model.safetensors"
    vfs = os.statvfs(directory)
    holds = vfs.f_blocks * vfs.f_frsize
    for bits in range(62, 30, -1):  # 4 EiB where the filesystem allows it (ext4 stops below 16 TiB)
        if 2**bits <= holds:
            break
        try:
            os.truncate(shard, 2**bits)
        except OSError as exc:
            if exc.errno in (errno.EFBIG, errno.EINVAL):
                continue
            raise
        _edit_manifest(
            directory, lambda files, n=2**bits: [f.update(size=n) for f in files if f["path"] == shard.name]
        )
        return 2**bits
    pytest.skip("this filesystem allows no sparse file larger than itself")


def test_rebuild_quick_refuses_a_file_larger_than_its_filesystem(rewind_env, run_name, tmp_path):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    _saved(run_name)
    size = _sparse_shard(root / run_name / "step-1")

    got = _cli(
        ["catalog", "rebuild", "--from", str(root), "--quick"],
        REWIND_CATALOG_URL=f"sqlite:///{tmp_path / 'fresh.db'}",
    )
    assert got.returncode == 1, (got.stdout, got.stderr)  # the old code imported it (sizes matched)
    (line,) = _not_imported(got.stdout)
    assert "model.safetensors" in line and str(size) in line and "filesystem" in line, line


def test_gc_dry_run_judges_a_file_larger_than_its_filesystem_unread(rewind_env, run_name, tmp_path):
    """A catalog an older rebuild filled took the sparse file's size on the manifest's word: ``gc --dry-run``
    proves the newest checkpoint before planning, and must not hash what cannot be a real file (the old code
    read zeros for hours). The copy comes out damaged, and nothing is planned away."""
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    _saved(run_name)
    where = root / run_name / "step-1"
    _sparse_shard(where)
    raw = (where / mf.MANIFEST_NAME).read_bytes()
    url = f"sqlite:///{tmp_path / 'rebuilt-by-an-older-rewind.db'}"
    cat = Catalog(url)
    run_id = lineage.ensure_run(cat, run_name)
    first = imported.FirstCopy("local", str(where), None, R.PENDING)
    imported.insert(cat, run_id, mf.parse(raw), digest=manifest_digest(raw), path=str(where), copy=first)

    started = time.monotonic()
    got = _cli(["gc", run_name, "--keep-last", "1", "--dry-run"], REWIND_CATALOG_URL=url)
    took = time.monotonic() - started
    assert got.returncode == 0, (got.stdout, got.stderr)
    assert took < WAIT_S
    (ck,) = lineage.checkpoints(cat, run_name, 1)
    (rep,) = lineage.replicas_of(cat, ck.id)
    assert rep.status == R.CORRUPT.value and "filesystem" in (rep.detail or ""), rep.detail


# -- item 9: the scrub's budget -----------------------------------------------------------------------


def test_scrub_stops_when_its_budget_is_spent_and_says_what_is_left(rewind_env, run_name, caplog):
    _saved(run_name, steps=(1, 2), width=256)  # a 256 KiB shard per checkpoint
    cat = Catalog()
    one, two = (lineage.checkpoints(cat, run_name, s)[0] for s in (1, 2))
    before = {s: copy_statuses(run_name, s) for s in (1, 2)}

    budget = Budget(max_bytes=64 << 10)  # spent a quarter of the way through the first shard
    with caplog.at_level(logging.WARNING, logger="rewind.scrub"):
        first = scrub(cat, one, deep=True, budget=budget)
        second = scrub(cat, two, deep=True, budget=budget)  # the same budget, spent: nothing is read
    assert budget.read == 64 << 10  # not a byte past it
    for check in (first, second):
        assert not check.ok and check.unchecked == 1
        (copy,) = check.copies
        assert copy.verdict is Verdict.UNVERIFIABLE  # nothing is known about its bytes
        assert copy.findings[0].problem is Problem.UNCHECKED and "budget spent" in str(copy.findings[0])
    assert {
        s: copy_statuses(run_name, s) for s in (1, 2)
    } == before  # nothing recorded on an unfinished check
    said = [r.getMessage() for r in caplog.records]
    assert any("budget spent" in m and "1 left unchecked" in m for m in said), said

    timed = scrub(cat, one, deep=True, budget=Budget(seconds=0))
    assert timed.unchecked == 1 and "0s" in str(timed.copies[0].findings[0])
    whole = scrub(cat, one, deep=True)  # the default budget: hours, far more than this needs
    assert whole.ok and whole.unchecked == 0


def test_a_whole_scrub_is_bounded_and_the_next_one_starts_with_what_it_did_not_reach(rewind_env, run_name):
    """`rewind ckpt verify --budget-s` bounds the whole run's checks: past it, what is left is reported
    unchecked (exit 3, nothing recorded), never as damage; a scrub takes the least recently checked first."""
    from rewind.infra.phases.verify import worth_checking

    _saved(run_name, steps=(1, 2, 3), width=256)
    cat = Catalog()
    before = {s: copy_statuses(run_name, s) for s in (1, 2, 3)}
    done = _cli(["ckpt", "verify", run_name, "--deep", "--budget-s", "0", "--json"])
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert [r["unchecked"] for r in json.loads(done.stdout)] == [1, 1, 1]
    assert {s: copy_statuses(run_name, s) for s in (1, 2, 3)} == before
    text = _cli(["ckpt", "verify", run_name, "--deep", "--budget-s", "0"])
    assert "step 1: UNCHECKED" in text.stdout and "0 checked, 0 with problems, 3 not reached" in text.stdout
    full = _cli(["ckpt", "verify", run_name, "--deep", "--step", "1"])
    assert full.returncode == 0, (full.stdout, full.stderr)
    scrub(cat, lineage.checkpoints(cat, run_name, 2)[0], deep=True)  # step 2 checked last
    assert [step for _, step, _ in worth_checking(cat, run=run_name)] == [3, 1, 2]


# -- items 13 and 11: a full disk ------------------------------------------------------------------


def _mount_tmpfs(where: Path, options: str) -> None:
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        pytest.skip("no mount command here: a full disk cannot be made")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (not root?): {done.stderr.strip()}")


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30, check=False)


@pytest.mark.parametrize(
    ("options", "said"),
    [("size=256k", "No space left on device"), ("size=16m,ro", "Read-only file system")],
    ids=["full", "read-only"],
)
def test_a_restore_onto_a_full_local_disk_blames_the_local_disk(
    rewind_env, run_name, tmp_path, capsys, options, said
):
    """The local copy is gone and the restore downloads the shared one onto a full (or read-only) local disk:
    one line naming the local disk (the old code recorded the *shared* copy unverifiable, ENOSPC blamed on
    it); the shared copy stays verified, and once the disk takes writes the same restore succeeds, bit for
    bit."""
    root, shared = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "shared"
    model = _saved(run_name, width=512)  # a 1 MiB shard: more than the disk below holds
    cat = Catalog()
    tier = open_tier(str(shared))
    tier.check()
    replicate(cat, lineage.checkpoints(cat, run_name, 1)[0], tier)
    assert copy_statuses(run_name, 1)["shared"] == "verified"
    run_dir = root / run_name
    shutil.rmtree(run_dir / "step-1")  # the local copy is gone

    _mount_tmpfs(run_dir, options)
    try:
        assert rewind(["ckpt", "restore", run_name, "--step", "1"]) == 2
        stderr = capsys.readouterr().err
        (err,) = [line for line in stderr.splitlines() if line.startswith("rewind:")]  # beside progress bars
        assert "local disk" in err and str(run_dir) in err and said in err, err
        assert copy_statuses(run_name, 1)["shared"] == "verified"  # the source is as it was
        assert not [p for p in run_dir.iterdir() if p.name.startswith("step-")]  # nothing half-written left
    finally:
        _umount(run_dir)

    assert rewind(["ckpt", "restore", run_name, "--step", "1"]) == 0
    restored, source = run_dir / "step-1", shared / run_name / "step-1"
    assert sorted(p.name for p in restored.iterdir()) == sorted(p.name for p in source.iterdir())
    for p in source.iterdir():
        assert (restored / p.name).read_bytes() == p.read_bytes()
    fresh = torch.nn.Linear(512, 512)
    ck = Checkpointer(run=run_name, states={"model": fresh})
    try:
        assert ck.restore_latest().step == 1  # type: ignore[union-attr]
    finally:
        ck.close()
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert copy_statuses(run_name, 1) == {"local": "verified", "shared": "verified"}


@pytest.mark.parametrize(
    ("options", "room", "said"),
    [
        ("size=256k", "remount,size=16m", "No space left on device"),
        ("size=16m,ro", "remount,rw", "Read-only file system"),
    ],
    ids=["full", "read-only"],
)
def test_a_replicate_onto_a_full_shared_disk_says_so_and_registers_nothing(
    rewind_env, run_name, tmp_path, options, room, said
):
    """`rewind replicate --to` a shared path whose disk is full (or read-only): one `rewind: error:` line
    naming the shared tier's directory and what its disk said, exit 2 (the old code: exit 70, 'a bug in
    Rewind'); no copy registered there, no manifest nor temporary file left, the local copy as it was. Once
    the same disk has room, the same command keeps what was placed and sends the rest; the copy verifies,
    bit for bit."""
    root, shared = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "shared"
    shared.mkdir()
    _saved(run_name, width=512)  # a 1 MiB shard: more than the disk below holds
    assert _cli(["ckpt", "verify", run_name, "--step", "1", "--deep"]).returncode == 0
    assert copy_statuses(run_name, 1) == {"local": "verified"}

    _mount_tmpfs(shared, options)
    try:
        got = _cli(["replicate", run_name, "--to", str(shared), "--no-retention"])
        assert got.returncode == 2, (got.stdout, got.stderr)
        (err,) = [line for line in got.stderr.splitlines() if line.startswith("rewind:")]  # beside progress
        assert err.startswith("rewind: error: ") and "a bug" not in err, err
        assert f"shared tier at {shared}" in err and said in err and f"{run_name} step 1" in err, err
        assert copy_statuses(run_name, 1) == {"local": "verified"}  # nothing registered, the source untouched
        # what was placed is no checkpoint: no manifest, no temporary file
        placed = {p: p.stat().st_ino for p in shared.rglob("*") if p.is_file()}
        assert not [p for p in placed if p.name == mf.MANIFEST_NAME or ".tmp-" in p.name], placed

        done = subprocess.run(["mount", "-o", room, str(shared)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr  # the same disk, with what was placed on it, now writable
        got = _cli(["replicate", run_name, "--to", str(shared), "--no-retention"])
        assert got.returncode == 0, (got.stdout, got.stderr)
        assert copy_statuses(run_name, 1) == {"local": "verified", "shared": "verified"}
        # what the full disk took was kept, not sent again
        assert {p: p.stat().st_ino for p in placed} == placed
        got = _cli(["ckpt", "verify", run_name, "--step", "1", "--deep", "--tier", "shared"])
        assert got.returncode == 0, (got.stdout, got.stderr)
        local, copy = root / run_name / "step-1", shared / run_name / "step-1"
        assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in local.iterdir())
        for p in local.iterdir():
            assert (copy / p.name).read_bytes() == p.read_bytes()
    finally:
        _umount(shared)
