"""A node-local copy is judged only where it can be seen: every local copy records its host.

One catalog, two machines (``REWIND_HOST_NAME`` names them; the checkpoint root of node-a is moved
away, as node-b would not see node-a's disk). From node-b, node-a's local copies are neither missing
nor corrupt: the scrub, `catalog check` and a restore leave them to node-a, and the restore reads the
shared copy. Node-a itself, whose directory is gone, finds them missing.
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
from tests.integrity_support import copy_statuses, statuses


def _rewind(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rewind.flows.cli", *args], env=os.environ,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.fixture
def two_hosts(rewind_env, run_name, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("REWIND_HOST_NAME", "node-a")
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    model = torch.nn.Linear(64, 64)
    ck = Checkpointer(run_name, states={"model": model}, root=root, catalog=Catalog())
    for step in (10, 20):
        ck.save(step)
    shared = tmp_path / "shared"
    done = _rewind("replicate", run_name, "--to", str(shared))
    assert done.returncode == 0, done.stderr
    assert _rewind("ckpt", "verify", run_name, "--deep").returncode == 0
    root.rename(tmp_path / "node-a-disk")  # node-b does not see node-a's disk, it has its own (empty)
    root.mkdir()
    return root, shared


def test_another_hosts_local_copy_is_left_to_it_and_the_shared_copy_restores(
    two_hosts, run_name, monkeypatch
):
    _, shared = two_hosts
    monkeypatch.setenv("REWIND_HOST_NAME", "node-b")
    (row,) = [r for r in lineage.replicas_of(Catalog(), lineage.checkpoints(Catalog(), run_name, 20)[0].id)
              if r.tier == "local"]  # fmt: skip
    assert row.host == "node-a"

    scrub = _rewind("ckpt", "verify", run_name, "--deep", "--json")
    assert scrub.returncode == 0, scrub.stdout + scrub.stderr
    for r in json.loads(scrub.stdout):
        assert r["ok"] and r["elsewhere"] == ["node-a"], r
        assert [c["tier"] for c in r["copies"]] == [str(shared)] or all(
            c["tier"] != "local" for c in r["copies"]
        )
    text = _rewind("ckpt", "verify", run_name, "--deep").stdout
    assert "on host node-a: checked there" in text, text
    assert copy_statuses(run_name, 20)["local"] == "verified"  # not "missing": nothing was judged here
    assert set(statuses(run_name).values()) == {"verified"}

    drift = _rewind("catalog", "check", "--run", run_name, "--json")
    assert drift.returncode == 0, drift.stdout  # node-a's rows are not drift from here

    restored = _rewind("ckpt", "restore", run_name, "--json")
    assert restored.returncode == 0, restored.stderr
    got = json.loads(restored.stdout)
    assert got["step"] == 20 and got["fetched"] and got["from"] != "local", got
    hosts = sorted((r.tier, r.host) for r in lineage.replicas_of(Catalog(), got["checkpoint_id"]))
    assert ("local", "node-a") in hosts and ("local", "node-b") in hosts  # both machines' copies kept


def test_the_copys_own_host_finds_it_missing(two_hosts, run_name, tmp_path):
    root, _ = two_hosts
    root.rmdir()
    (tmp_path / "node-a-disk").rename(root)  # node-a's disk is there; one copy on it is gone
    gone = Path(lineage.checkpoints(Catalog(), run_name, 20)[0].path)
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    scrub = _rewind("ckpt", "verify", run_name, "--step", "20", "--tier", "local")
    assert scrub.returncode == 1, scrub.stdout + scrub.stderr  # node-a: the copy is gone, and it says so
    assert copy_statuses(run_name, 20)["local"] == "missing"
