"""Integrity outside the commit protocol: every copy held to the catalog, nothing restored, replicated or
deleted on trust. One test per way it used to go wrong (issue 11), on the real Postgres catalog, a shared
path and real training processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rewind.flows.cli import main as rewind
from rewind.infra import faults, retention
from rewind.infra.catalog import leases, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.checkpoint.state import RNGState
from rewind.infra.errors import CheckpointUnverifiable, ConfigError, StateMismatch
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_file, manifest_digest
from rewind.infra.format.verify import verify_files
from rewind.infra.restore import execute, plan
from rewind.infra.serving.export import verified_checkpoint
from tests.integrity_support import copy_statuses, flip, statuses
from tests.trainproc import TrainProc, assert_same_weights


class GeneratorState:
    """A data source with its own torch.Generator, as torchdata's StatefulDataLoader keeps one."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.weights = torch.randn(16)  # saved before the generator state in the same file

    def draw(self) -> torch.Tensor:
        return torch.randint(0, 1000, (8,), generator=self.gen)

    def state_dict(self) -> dict:
        return {"weights": self.weights, "gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.weights = sd["weights"]
        self.gen.set_state(sd["gen"])


def _job(run: str, root: Path, seed: int = 0) -> tuple[Checkpointer, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    states = {"model": model, "optimizer": opt, "rng": RNGState(), "data": GeneratorState(seed)}
    return Checkpointer(run, states=states, root=root, catalog=Catalog()), model


def _save(run: str, root: Path, steps: list[int], seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Checkpoints at ``steps`` of a model that changes between them; the weights saved at each."""
    ck, model = _job(run, root, seed)
    saved = {}
    for s in steps:
        with torch.no_grad():
            model.weight.add_(float(s))
        ck.save(s)
        saved[s] = {k: v.clone() for k, v in model.state_dict().items()}
    ck.close()
    return saved


def _restore(run: str, root: Path, seed: int = 99):  # type: ignore[no-untyped-def]
    ck, model = _job(run, root, seed)
    got = ck.restore_latest()
    return got, model, ck


def _json(capsys, args: list[str]) -> tuple[int, object]:  # type: ignore[no-untyped-def]
    capsys.readouterr()
    code = rewind([*args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def _same(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


# 3 -------------------------------------------------------------------------------------------


def test_good_replica_restores_after_a_scrub_condemned_the_local_copy(rewind_env, run_name, tmp_path, capsys):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    saved = _save(run_name, root, [10, 20])
    assert rewind(["replicate", run_name, "--to", str(tmp_path / "shared")]) == 0
    local20 = root / run_name / "step-20"
    flip(local20 / "model.safetensors")

    code, report = _json(capsys, ["ckpt", "verify", run_name, "--deep"])
    assert code == 1
    by_step = {r["step"]: r for r in report}
    assert {c["tier"]: c["verdict"] for c in by_step[20]["copies"]} == {
        "local": "corrupt",
        "shared": "verified",
    }
    assert statuses(run_name)[20] == "verified"  # a bad local copy says nothing about the replica
    assert not local20.exists()  # quarantined
    assert (root / run_name / ".quarantine").is_dir()

    assert rewind(["ckpt", "restore", run_name, "--step", "20", "--from", "shared"]) == 0
    got, model, _ = _restore(run_name, root)
    assert got.step == 20 and _same(model, saved[20])
    assert copy_statuses(run_name, 20) == {"local": "verified", "shared": "verified"}


def test_a_damaged_replica_never_displaces_a_good_local_copy(rewind_env, run_name, tmp_path, capsys):
    root, shared = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "shared"
    saved = _save(run_name, root, [10])
    assert rewind(["replicate", run_name, "--to", str(shared)]) == 0
    flip(shared / run_name / "step-10" / "model.safetensors")
    assert rewind(["ckpt", "restore", run_name, "--step", "10", "--from", "shared"]) == 2
    assert (root / run_name / "step-10").is_dir()  # still in place: the download never proved itself
    assert copy_statuses(run_name, 10) == {"local": "verified", "shared": "corrupt"}
    assert statuses(run_name)[10] == "verified"
    got, model, _ = _restore(run_name, root)
    assert got.step == 10 and _same(model, saved[10])


# 4 -------------------------------------------------------------------------------------------


def test_tampered_replica_is_refused_and_never_exported(rewind_env, run_name, tmp_path, capsys):
    root, shared = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "shared"
    saved = _save(run_name, root, [10, 20])
    assert rewind(["replicate", run_name, "--to", str(shared)]) == 0
    # Swap the replica of step 20 for step 10's files, manifest included: self-consistent, but not step 20.
    shutil.rmtree(shared / run_name / "step-20")
    shutil.copytree(shared / run_name / "step-10", shared / run_name / "step-20")
    shutil.rmtree(root / run_name / "step-20")  # so a restore must come from the replica

    capsys.readouterr()
    assert rewind(["ckpt", "restore", run_name, "--step", "20", "--from", "shared"]) == 2
    err = capsys.readouterr().err
    assert "not the manifest the catalog recorded" in err and len(err.strip().splitlines()) == 1
    assert not (root / run_name / "step-20").exists()  # nothing installed
    assert copy_statuses(run_name, 20)["shared"] == "corrupt"

    got, model, _ = _restore(run_name, root)
    assert got.step == 10 and _same(model, saved[10])
    assert statuses(run_name)[20] == "corrupt"  # no copy left that verifies
    with pytest.raises(ConfigError, match="not verified"):
        verified_checkpoint(Catalog(), run_name, 20)


# 5 -------------------------------------------------------------------------------------------


def test_replication_after_a_rollback_sends_the_new_timeline(rewind_env, run_name, tmp_path, capsys):
    root, shared = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "shared"
    _save(run_name, root, [10, 20])
    assert rewind(["replicate", run_name, "--to", str(shared)]) == 0
    cat = Catalog()
    lineage.supersede_after(cat, lineage.get_run(cat, run_name).id, 10, "rolled back")
    got, model, ck = _restore(run_name, root, seed=5)
    assert got.step == 10
    with torch.no_grad():
        model.weight.mul_(-1.0)  # another timeline from step 10 on
    ck.save(20)
    ck.close()
    new_timeline = {k: v.clone() for k, v in model.state_dict().items()}

    code, rows = _json(capsys, ["replicate", run_name, "--to", str(shared)])
    assert code == 0
    (row,) = rows
    assert row["step"] == 20 and row["bytes_sent"] > 0
    assert row["key"].startswith(f"{run_name}/step-20.")  # the old timeline's copy keeps its name
    assert (shared / run_name / "step-20" / "manifest.json").exists()

    shutil.rmtree(root)  # the node is gone: step 20 must come back from the shared copy, new timeline
    got, model, _ = _restore(run_name, root)
    assert got.step == 20 and _same(model, new_timeline)


# 6 -------------------------------------------------------------------------------------------


def test_gc_never_deletes_the_last_verified_checkpoint(reference, rewind_env, run_name, tmp_path, capsys):
    ref_losses, ref_final = reference
    first = TrainProc(run_name, tmp_path / "out", extra=["--stop-after", "35"])
    assert first.finish() and first.proc.returncode == 0
    flip(Path(rewind_env["REWIND_CHECKPOINT_ROOT"]) / run_name / "step-30" / "optimizer.safetensors")

    code, out = _json(capsys, ["gc", run_name, "--keep-last", "1"])
    assert code == 0
    assert out["verified_first"] == [30, 20]  # nobody had proven them: GC did before deleting anything
    assert out["keep"] == [20] and out["removed"] == [10]
    assert statuses(run_name) == {10: "deleted", 20: "verified", 30: "corrupt"}

    second = TrainProc(run_name, tmp_path / "out")
    out2 = second.finish()
    assert second.proc.returncode == 0 and out2.resumed_at == 20, out2.text
    assert all(ref_losses[s] == loss for s, loss in out2.losses.items())
    assert_same_weights(tmp_path / "out" / "final.safetensors", ref_final)


# 7 (the lease half; the roll-back half runs the restore-checkpoint flow in test_integrity_flows.py) ----


def test_gc_leaves_a_checkpoint_being_restored_alone(rewind_env, run_name, tmp_path):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    saved = _save(run_name, root, [10, 20, 30])
    cat = Catalog()
    for ck in lineage.checkpoints(cat, run_name):
        assert rewind(["ckpt", "verify", run_name, "--step", str(ck.step), "--deep"]) == 0
    policy = retention.Policy(keep_last=1)
    gc = retention.plan(cat, run_name, policy)
    assert sorted(r.step for r in gc.remove) == [10, 20]
    p = plan.plan(cat, run_name, root=root, step=10)
    with execute.restoring(cat, p, verify_files) as held:  # a restore of step 10 is under way
        assert leases.leased(cat, held.checkpoint_id)
        assert retention.execute(cat, gc, policy) == [20]
    assert statuses(run_name) == {10: "verified", 20: "deleted", 30: "verified"}
    assert not leases.leased(cat, held.checkpoint_id)
    assert not (root / run_name / "step-20").exists() and (root / run_name / "step-10").is_dir()
    assert saved  # step 10's bytes are what the restore read


# 8 -------------------------------------------------------------------------------------------


def test_key_rotation_keeps_every_checkpoint(rewind_env, run_name, monkeypatch):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    _save(run_name, root, [10, 20])  # unsigned
    monkeypatch.setenv("REWIND_MANIFEST_KEY", "key-one")  # signing turned on
    got, _, ck = _restore(run_name, root)
    assert got.step == 20  # unsigned checkpoints are not condemned by turning signing on
    ck.save(30)
    ck.close()
    monkeypatch.setenv("REWIND_MANIFEST_KEY", "key-two")  # rotated
    monkeypatch.setenv("REWIND_MANIFEST_PREVIOUS_KEYS", "key-one")
    got, _, ck = _restore(run_name, root)
    assert got.step == 30
    ck.save(40)
    ck.close()

    monkeypatch.setenv("REWIND_MANIFEST_KEY", "key-three")  # a process without the keys that signed 30, 40
    monkeypatch.delenv("REWIND_MANIFEST_PREVIOUS_KEYS")
    with pytest.raises(CheckpointUnverifiable, match="unknown_key"):
        _restore(run_name, root)
    assert set(statuses(run_name).values()) <= {
        "committed",
        "verified",
    }  # unknown key: unverifiable, not corrupt
    assert copy_statuses(run_name, 40)["local"] == "unverifiable"

    monkeypatch.delenv("REWIND_MANIFEST_KEY")  # signing off again: nothing was lost
    got, _, _ = _restore(run_name, root)
    assert got.step == 40
    monkeypatch.setenv("REWIND_MANIFEST_KEY", "key-two")
    monkeypatch.setenv("REWIND_MANIFEST_STRICT", "1")  # strict: unsigned ones are refused, signed ones verify
    assert rewind(["ckpt", "verify", run_name, "--step", "40", "--deep"]) == 0
    assert rewind(["ckpt", "verify", run_name, "--step", "20", "--deep"]) == 1
    assert statuses(run_name)[20] == "corrupt"


# 9 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["eio", "eacces"])
def test_transient_read_errors_never_condemn(fault, rewind_env, run_name, monkeypatch, capsys):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    _save(run_name, root, [10, 20])
    faults._hits.clear()
    monkeypatch.setenv("REWIND_FAULT", f"{fault}:verify.read#1")  # the first read fails, once
    code, report = _json(capsys, ["ckpt", "verify", run_name, "--step", "20", "--deep"])
    assert code == 3 and report[0]["copies"][0]["verdict"] == "unverifiable"  # not provable now: exit 3
    assert statuses(run_name)[20] == "committed"
    faults._hits.clear()
    with pytest.raises(CheckpointUnverifiable):  # never an older checkpoint over one that may be good
        _restore(run_name, root)
    assert statuses(run_name)[20] == "committed"

    monkeypatch.delenv("REWIND_FAULT")
    code, report = _json(capsys, ["ckpt", "verify", run_name, "--step", "20", "--deep"])
    assert code == 0 and report[0]["copies"][0]["verdict"] == "verified"
    assert statuses(run_name)[20] == "verified" and copy_statuses(run_name, 20) == {"local": "verified"}


# 10 ------------------------------------------------------------------------------------------


def _rewrite(run: str, root: Path, step: int, name: str, data: bytes) -> None:
    """What a buggy writer leaves: a file whose digest matches its manifest and the catalog's record."""
    d = root / run / f"step-{step}"
    (d / name).write_bytes(data)
    body = json.loads((d / mf.MANIFEST_NAME).read_text())
    dig = hash_file(d / name)
    for f in body["files"]:
        if f["path"] == name:
            f.update(size=dig.size, xxh3=dig.xxh3, crc32c=dig.crc32c)
    raw = (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
    (d / mf.MANIFEST_NAME).write_bytes(raw)
    cat = Catalog()
    (ck,) = [c for c in lineage.checkpoints(cat, run, step) if c.status in ("committed", "verified")]
    with cat.session() as s:
        s.get(type(ck), ck.id).manifest_digest = manifest_digest(raw)


@pytest.mark.parametrize("bad", ["wrong_types", "not_a_state"])
def test_state_that_does_not_load_falls_back_and_is_condemned(bad, rewind_env, run_name):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    saved = _save(run_name, root, [10, 20])
    state_file = root / run_name / "step-20" / "state.json"
    tree = json.loads(state_file.read_text())
    if bad == "wrong_types":  # decodes, but RNG state of the wrong type: load_state_dict refuses it
        tree["rng"]["python"] = "not an RNG state"
        data = json.dumps(tree).encode()
    else:  # not one state per part at all
        data = b"[1, 2, 3]"
    _rewrite(run_name, root, 20, "state.json", data)

    got, model, ck = _restore(run_name, root)
    assert got.step == 10 and _same(model, saved[10])
    (skip,) = ck.skipped
    assert skip.step == 20 and skip.outcome in ("mismatch", "unloadable")
    status = {c.step: c for c in lineage.checkpoints(Catalog(), run_name)}
    assert status[20].status == "corrupt" and status[20].status_reason.startswith("content: ")


def test_a_job_that_changed_shape_condemns_nothing(rewind_env, run_name):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    _save(run_name, root, [10, 20])
    other = Checkpointer(run_name, states={"model": torch.nn.Linear(4, 4)}, root=root, catalog=Catalog())
    with pytest.raises(StateMismatch, match="no checkpoint fits this job"):
        other.restore_latest()
    assert set(statuses(run_name).values()) == {"committed"}


# 11 ------------------------------------------------------------------------------------------


def test_restored_tensors_own_their_storage(rewind_env, run_name):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    ck, _ = _job(run_name, root)
    data = ck.states["data"]
    data.draw()
    ck.save(1)
    ck.close()
    expected = [data.draw() for _ in range(3)]
    got, _, again = _restore(run_name, root)
    assert got.step == 1
    fresh = again.states["data"]
    assert [torch.equal(fresh.draw(), e) for e in expected] == [True] * 3
    sd = fresh.state_dict()
    assert sd["weights"].storage_offset() == 0


# 12 ------------------------------------------------------------------------------------------


def test_resaved_step_is_not_judged_by_dead_rows_and_dead_copies_are_reclaimed(rewind_env, run_name, capsys):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    _save(run_name, root, [10, 20, 30])
    flip(root / run_name / "step-30" / "model.safetensors")
    got, _, ck = _restore(run_name, root)
    assert got.step == 20 and statuses(run_name)[30] == "corrupt"
    ck.save(30)  # the job goes on and saves step 30 again
    ck.close()

    code, report = _json(capsys, ["ckpt", "verify", run_name, "--deep"])
    assert code == 0, report
    assert sorted(r["step"] for r in report) == [10, 20, 30] and all(r["ok"] for r in report)
    dead = [c for c in lineage.checkpoints(Catalog(), run_name, 30) if c.status == "superseded"]
    assert len(dead) == 1 and ".quarantine" in lineage.replicas_of(Catalog(), dead[0].id)[0].uri

    held = [p.stat().st_size for p in (root / run_name / ".quarantine").rglob("*") if p.is_file()]
    code, out = _json(capsys, ["gc", run_name, "--keep-last", "3", "--grace-days", "0"])
    assert code == 0 and [r["step"] for r in out["reclaim"]] == [30] and out["quarantine"]
    # The dead copy's row names the quarantined directory: its files are counted once.
    assert out["reclaimable"]["local"] == {"files": len(held), "bytes": sum(held)}
    assert not list((root / run_name / ".quarantine").iterdir())
    assert {r.status for r in lineage.replicas_of(Catalog(), dead[0].id)} == {"deleted"}
    assert sorted(p.name for p in (root / run_name).glob("step-*")) == ["step-10", "step-20", "step-30"]


def test_gc_never_follows_a_dead_row_into_a_live_directory(rewind_env, run_name, capsys):
    root = Path(rewind_env["REWIND_CHECKPOINT_ROOT"])
    _save(run_name, root, [10, 20, 30])
    shutil.rmtree(root / run_name / "step-30")  # lost; the run falls back to 20 and saves 30 again
    got, _, ck = _restore(run_name, root)
    assert got.step == 20
    ck.save(30)
    ck.close()
    code, _ = _json(capsys, ["gc", run_name, "--keep-last", "3", "--grace-days", "0"])
    assert code == 0
    assert rewind(["ckpt", "verify", run_name, "--step", "30", "--deep"]) == 0  # the new step 30 is intact
