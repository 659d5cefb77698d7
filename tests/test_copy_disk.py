"""A node-local copy is judged only where its disk is seen: every local copy records its disk.

One catalog, two machines with the same checkpoint path on different disks (node-a's disk is moved away
and node-b's, marked as a tier of its own, takes its path). From node-b, node-a's local copies are neither
missing nor corrupt: the scrub, `catalog check` and a restore leave them alone, and the restore reads the
shared copy into a row of node-b's own; damage to node-b's copy is node-b's, not node-a's. Node-a, whose
disk lost a copy, finds it missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.format import local_tier
from tests.integrity_support import flip, statuses


def _rewind(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rewind.flows.cli", *args], env=os.environ,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _local_rows(run: str, step: int) -> dict[str | None, str]:
    cat = Catalog()
    (ck,) = [c for c in lineage.checkpoints(cat, run, step) if c.status not in ("superseded", "aborted")]
    return {r.tier_id: str(r.status) for r in lineage.replicas_of(cat, ck.id) if r.tier == "local"}


@pytest.fixture
def two_disks(rewind_env, run_name, tmp_path):  # type: ignore[no-untyped-def]
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    ck = Checkpointer(run_name, states={"model": torch.nn.Linear(64, 64)}, root=root, catalog=Catalog())
    for step in (10, 20):
        ck.save(step)
    disk_a = local_tier.read(root)
    assert disk_a is not None  # the first save marked the tier
    done = _rewind("replicate", run_name, "--to", str(tmp_path / "shared"))
    assert done.returncode == 0, done.stderr
    assert _rewind("ckpt", "verify", run_name, "--deep").returncode == 0
    root.rename(tmp_path / "node-a-disk")  # node-b: the same path, its own disk
    disk_b = local_tier.ensure(root)
    assert disk_b.id != disk_a.id
    return root, disk_a, disk_b


def test_another_disks_copy_is_left_alone_and_the_shared_copy_restores(two_disks, run_name):
    root, disk_a, disk_b = two_disks
    assert _local_rows(run_name, 20) == {disk_a.id: "verified"}

    scrub = _rewind("ckpt", "verify", run_name, "--deep", "--json")
    assert scrub.returncode == 0, scrub.stdout + scrub.stderr
    for r in json.loads(scrub.stdout):
        assert r["ok"] and r["elsewhere"] == [disk_a.host], r
        assert all(c["tier"] != "local" for c in r["copies"]), r  # only the shared copy was checked here
    text = _rewind("ckpt", "verify", run_name, "--deep").stdout
    assert f"on a disk of host {disk_a.host} not seen here" in text, text
    assert _local_rows(run_name, 20) == {disk_a.id: "verified"}  # not "missing": nothing was judged here
    assert set(statuses(run_name).values()) == {"verified"}
    drift = _rewind("catalog", "check", "--run", run_name, "--json")
    assert drift.returncode == 0, drift.stdout  # node-a's rows are not drift from here

    restored = _rewind("ckpt", "restore", run_name, "--json")
    assert restored.returncode == 0, restored.stderr
    got = json.loads(restored.stdout)
    assert got["step"] == 20 and got["fetched"] and got["from"] != "local", got
    assert _local_rows(run_name, 20) == {
        disk_a.id: "verified",
        disk_b.id: "verified",
    }  # two disks, two copies

    flip(root / run_name / "step-20" / "model.safetensors")  # node-b's copy, at node-a's copy's path
    bad = _rewind("ckpt", "verify", run_name, "--step", "20", "--deep", "--tier", "local")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert _local_rows(run_name, 20) == {disk_a.id: "verified", disk_b.id: "corrupt"}


def test_the_copys_own_disk_finds_it_missing(two_disks, run_name, tmp_path):
    root, disk_a, _ = two_disks
    (root / local_tier.MARK).unlink()
    root.rmdir()
    (tmp_path / "node-a-disk").rename(root)  # node-a again: its disk is there, one copy on it is gone
    gone = Path(lineage.checkpoints(Catalog(), run_name, 20)[0].path)
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    scrub = _rewind("ckpt", "verify", run_name, "--step", "20", "--tier", "local")
    assert scrub.returncode == 1, (
        scrub.stdout + scrub.stderr
    )  # its own disk: the copy is gone, and it says so
    assert _local_rows(run_name, 20) == {disk_a.id: "missing"}


def test_a_dead_copy_here_is_reclaimed_though_another_disk_holds_a_live_one_at_its_path(
    two_disks, run_name, tmp_path
):
    """Node-local paths repeat across hosts: node-a saving step 20 again must not keep node-b's dead copy."""
    root, disk_a, disk_b = two_disks
    assert _rewind("ckpt", "restore", run_name, "--json").returncode == 0  # node-b's own copy of step 20
    mine = root / run_name / "step-20"
    assert mine.is_dir() and _local_rows(run_name, 20) == {disk_a.id: "verified", disk_b.id: "verified"}

    root.rename(tmp_path / "node-b-disk")  # node-a again: it saves step 20 anew (a replayed timeline)
    (tmp_path / "node-a-disk").rename(root)
    ck = Checkpointer(run_name, states={"model": torch.nn.Linear(64, 64)}, root=root, catalog=Catalog())
    ck.save(20)
    ck.close()
    assert _local_rows(run_name, 20) == {disk_a.id: "pending"}  # the new checkpoint, on node-a's disk alone
    root.rename(tmp_path / "node-a-disk")  # node-b again: its copy of the old step 20 is dead
    (tmp_path / "node-b-disk").rename(root)

    gc = _rewind("gc", run_name, "--grace-days", "0", "--keep-last", "5")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert not mine.exists()  # reclaimed: node-a's live copy lies on another disk
    assert (tmp_path / "node-a-disk" / run_name / "step-20").is_dir()  # which nobody here touched
