"""The catalog is state too: rebuilt from the manifests on storage, checked against storage,
backed up and restored with Postgres's own tools."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import torch

from rewind.flows.cli import main as rewind
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.checkpoint.state import RNGState
from rewind.infra.format import manifest as mf
from rewind.infra.inventory.rebuild import rebuild
from rewind.infra.replication import replicate
from rewind.infra.tiers import open_tier
from tests.conftest import ADMIN_URL
from tests.integrity_support import flip
from tests.s3_support import BUCKET
from tests.trainproc import TrainProc, assert_same_weights

SEED = 0  # every model here starts from torch.manual_seed(SEED)


def _job(run: str, cat: Catalog, root: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Checkpointer]:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(
        run, states={"model": model, "optimizer": opt, "rng": RNGState()}, root=root, catalog=cat
    )
    return model, opt, ck


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _lineage(cat: Catalog, run: str) -> dict[str, tuple[int, str | None, bool]]:
    """manifest digest -> (step, parent's manifest digest, restorable) for every checkpoint with bytes."""
    rows = [c for c in lineage.checkpoints(cat, run) if c.manifest_digest]
    digest = {c.id: c.manifest_digest for c in rows}
    return {
        str(c.manifest_digest): (
            c.step,
            digest.get(c.parent_id) if c.parent_id else None,
            c.status in ("committed", "verified"),
        )
        for c in rows
    }


def _save_replicated(cat: Catalog, ck: Checkpointer, shared: str, model, opt, steps) -> None:  # type: ignore[no-untyped-def]
    for s in steps:
        _step(model, opt)
        ck.save(s)
    tier = open_tier(shared)
    tier.check()
    for c in lineage.restorable(cat, lineage.get_run(cat, ck.run).id):
        replicate(cat, c, tier)


def test_rebuild_recreates_lineage_across_a_roll_back(rewind_env, run_name, tmp_path):
    root, shared = tmp_path / "ckpt", str(tmp_path / "shared")
    cat = Catalog(f"sqlite:///{tmp_path / 'original.db'}")
    model, opt, ck = _job(run_name, cat, root)
    _save_replicated(cat, ck, shared, model, opt, [10, 20, 30, 40])
    ck.close()
    lineage.supersede_after(cat, lineage.get_run(cat, run_name).id, 20, "rolled back: loss spike")
    model, opt, ck = _job(run_name, cat, root)
    assert ck.restore_latest().step == 20
    _save_replicated(cat, ck, shared, model, opt, [30])  # a new timeline: shared holds step-30.<digest>
    ck.close()
    head = {k: v.clone() for k, v in model.state_dict().items()}
    original = _lineage(cat, run_name)
    assert sum(1 for *_, live in original.values() if not live) == 2  # the old 30 and 40
    (Path(shared) / run_name / "step-10" / mf.MANIFEST_NAME).write_bytes(
        b'{"format": "rewind.checkpoint/3", "run'
    )

    hostile = Path(shared) / "bad\x07run" / "step-20"  # a run name Rewind never creates: reported, not fatal
    shutil.copytree(Path(shared) / run_name / "step-20", hostile)
    body = json.loads((hostile / mf.MANIFEST_NAME).read_text()) | {"run": "bad\x07run"}
    (hostile / mf.MANIFEST_NAME).write_text(json.dumps(body))

    fresh = Catalog(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    from_local = rebuild(fresh, str(root), run=run_name)
    from_shared = rebuild(fresh, shared)
    assert from_local.tier == "local" and not from_local.refused
    refused = {r.key: r.reason for r in from_shared.refused}
    assert refused.keys() == {f"{run_name}/step-10", "bad\x07run/step-20"}, refused
    assert "not valid JSON" in refused[f"{run_name}/step-10"]
    assert "control characters" in refused["bad\x07run/step-20"]
    assert _lineage(fresh, run_name) == original  # every step, parent and timeline, the old 30 and 40 too
    again = rebuild(fresh, shared)
    assert {p.action for p in again.placed} == {"known copy"}  # idempotent
    assert _lineage(fresh, run_name) == original

    model, opt, ck = _job(run_name, fresh, root)
    assert ck.restore_latest().step == 30  # the new timeline's head, not the abandoned step 40
    assert all(torch.equal(v, head[k]) for k, v in model.state_dict().items())


def _copies(run: str) -> dict[int, dict[str, str]]:
    cat = Catalog()
    return {
        c.step: {r.tier: str(r.status) for r in lineage.replicas_of(cat, c.id)}
        for c in lineage.checkpoints(cat, run)
    }


def _pg(tool: str, *args: str) -> None:
    subprocess.run([tool, *args], check=True, capture_output=True, timeout=120)


def _recreate(url: str) -> str:
    """Drop the catalog database and create it empty; returns its libpq URL."""
    name = url.rsplit("/", 1)[1]
    admin = ADMIN_URL
    _pg("psql", admin, "-qc", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    _pg("psql", admin, "-qc", f'CREATE DATABASE "{name}"')
    return f"{admin.rsplit('/', 1)[0]}/{name}"


def _check(*args: str, capsys) -> tuple[int, list[dict]]:  # type: ignore[no-untyped-def]
    capsys.readouterr()
    rc = rewind(["catalog", "check", "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def test_catalog_backup_check_and_rebuild_from_each_tier(
    reference, s3_env, rewind_env, fresh_pg_url, run_name, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("REWIND_CATALOG_URL", fresh_pg_url)
    root, shared, offsite = (
        Path(rewind_env["REWIND_CHECKPOINT_ROOT"]),
        tmp_path / "shared",
        f"s3://{BUCKET}/dr-{run_name}",
    )
    first = TrainProc(run_name, tmp_path / "out", extra=["--stop-after", "35"])
    assert first.finish() and first.proc.returncode == 0
    assert rewind(["replicate", run_name, "--to", str(shared)]) == 0
    assert rewind(["replicate", run_name, "--to", offsite]) == 0
    original = _lineage(Catalog(), run_name)
    assert {s: set(t) for s, t in _copies(run_name).items()} == {
        s: {"local", "shared", "offsite"} for s in (10, 20, 30)
    }

    # Backup and restore with Postgres's own tools; Rewind works on against the restored database.
    dump = tmp_path / "catalog.dump"
    libpq = fresh_pg_url.replace("+psycopg", "")
    _pg("pg_dump", "--format=custom", f"--file={dump}", libpq)
    _pg("pg_restore", "--no-owner", f"--dbname={_recreate(fresh_pg_url)}", str(dump))
    assert _lineage(Catalog(), run_name) == original
    assert _check("--deep", capsys=capsys) == (0, [])

    # Drift, one of each kind: a row without files, files without a row, bytes that differ.
    shutil.rmtree(shared / run_name / "step-20")
    cat = Catalog()
    (ck10,) = [c for c in lineage.checkpoints(cat, run_name, 10)]
    with cat.session() as s:
        for r in lineage.replicas_of(cat, ck10.id):
            if r.tier == "offsite":
                s.delete(s.get(type(r), r.id))
    flip(root / run_name / "step-30" / "optimizer.safetensors")
    rc, found = _check("--deep", capsys=capsys)
    kinds = {(f["kind"], f["tier"], f["step"]) for f in found}
    assert rc == 1 and kinds == {
        ("row_without_files", "shared", 20),
        ("files_without_row", "offsite", 10),
        ("bytes_differ", "local", 30),
    }, found

    # The catalog is lost with no backup left: rebuild it from the tiers.
    _recreate(fresh_pg_url)
    assert rewind(["catalog", "rebuild", "--from", str(root)]) == 1  # step 30's local copy is damaged
    assert rewind(["catalog", "rebuild", "--from", str(shared)]) == 0
    assert rewind(["catalog", "rebuild", "--from", offsite]) == 0
    assert _lineage(Catalog(), run_name) == original
    assert _copies(run_name) == {  # every copy that still verifies, and only those
        10: {"local": "verified", "shared": "verified", "offsite": "verified"},
        20: {"local": "verified", "offsite": "verified"},
        30: {"shared": "verified", "offsite": "verified"},
    }
    rc, found = _check("--deep", capsys=capsys)
    assert [(f["kind"], f["tier"], f["step"]) for f in found] == [("files_without_row", "local", 30)]

    second = TrainProc(run_name, tmp_path / "out")
    out = second.finish()
    assert second.proc.returncode == 0 and out.resumed_at == 30, out.text  # from the shared copy
    assert all(reference[0][s] == loss for s, loss in out.losses.items())
    assert_same_weights(tmp_path / "out" / "final.safetensors", reference[1])
