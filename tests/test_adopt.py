"""Checkpoints Rewind did not write, taken under protection: plain DCP (one process and two ranks), a
TorchTitan-shaped ``step-N`` directory and a real ``transformers.Trainer`` run are adopted, replicated
to S3, restored after the local directory is gone, and resumed; a tampered adopted file is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from rewind.flows.cli import main as rewind
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import NoRestorableCheckpoint
from rewind.infra.restore.foreign import load_dcp, verified_directory
from tests.integrity_support import flip
from tests.s3_support import BUCKET
from tests.torchrun_support import torchrun

REPO = Path(__file__).resolve().parents[1]


def _adopt(capsys, *args: str) -> dict:  # type: ignore[no-untyped-def]
    capsys.readouterr()
    assert rewind(["adopt", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_dcp_and_torchtitan_checkpoints_adopted_replicated_restored(
    s3_env, rewind_env, run_name, tmp_path, capsys
):
    model, opt = _model(0)
    titan = tmp_path / "titan" / "checkpoint" / "step-7"  # TorchTitan's layout: <dump>/checkpoint/step-<N>/
    dcp.save(_state(model, opt), checkpoint_id=str(titan))
    got = _adopt(capsys, str(titan), "--run", run_name)
    assert (got["format"], got["step"], got["action"]) == ("torchtitan", 7, "adopted")
    assert _adopt(capsys, str(titan), "--run", run_name)["action"] == "already adopted"
    assert rewind(["replicate", run_name, "--to", f"s3://{BUCKET}/adopt-{run_name}"]) == 0
    shutil.rmtree(titan)  # the node and its disk
    capsys.readouterr()
    assert rewind(["catalog", "check", "--run", run_name, "--json"]) == 1  # an adopted copy lies anywhere
    assert [(f["kind"], f["tier"]) for f in json.loads(capsys.readouterr().out)] == [
        ("row_without_files", "local")
    ]

    fresh, fresh_opt = _model(1)
    state = _state(fresh, fresh_opt)
    assert load_dcp(state, run=run_name) == 7  # fetched from S3, every byte checked as DCP read it
    fresh.load_state_dict(state["model"])
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )

    plain = tmp_path / "exported_dcp"  # a name that says no step: the user must
    dcp.save(_state(model, opt), checkpoint_id=str(plain))
    assert rewind(["adopt", str(plain), "--run", f"{run_name}-p"]) == 2
    assert "give --step" in capsys.readouterr().err
    assert _adopt(capsys, str(plain), "--run", f"{run_name}-p", "--step", "3")["format"] == "dcp"
    shard = next(plain.glob("*.distcp"))
    flip(shard)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    state = _state(fresh, fresh_opt)
    with pytest.raises(NoRestorableCheckpoint, match="corrupt"):
        load_dcp(state, run=f"{run_name}-p")
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # nothing loaded from it
    assert shard.exists()  # the user's directory is recorded corrupt, not moved: Rewind did not write it
    (ck,) = lineage.checkpoints(Catalog(), f"{run_name}-p")
    assert ck.status == "corrupt"


def test_dcp_checkpoint_of_two_ranks_adopted_and_loaded_on_two_ranks(rewind_env, run_name, tmp_path):
    directory = tmp_path / "ckpt" / "step-5"
    cmd = [*torchrun(2), "-m", "tests.adopt_worker", str(directory), run_name]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(list(directory.glob("__*_*.distcp"))) == 2
    (ck,) = lineage.checkpoints(Catalog(), run_name)
    assert ck.layout["world_size"] == 2 and ck.pinned
    saved, loaded = load_file(f"{directory}-save.safetensors"), load_file(f"{directory}-load.safetensors")
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


def _trainer(out: Path, stop_after: int | None = None):  # type: ignore[no-untyped-def]
    """Six steps of a tiny Llama, a checkpoint every three; ``stop_after`` interrupts it once that is saved."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            control.should_training_stop = state.global_step == stop_after
            return control

    set_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (48, 16), generator=g)]
    args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_steps=3,
                             save_strategy="steps", learning_rate=1e-2, seed=0, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, logging_strategy="no", disable_tqdm=True)  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[Interrupt()])


def test_hf_trainer_checkpoint_adopted_restored_and_resumed(s3_env, rewind_env, run_name, tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    reference = _trainer(tmp_path / "ref")
    reference.train()
    cut = _trainer(tmp_path / "cut", stop_after=3)
    cut.train()
    assert sorted(p.name for p in (tmp_path / "cut").glob("checkpoint-*")) == ["checkpoint-3"]
    got = _adopt(capsys, str(tmp_path / "cut" / "checkpoint-3"), "--run", run_name)
    assert (got["format"], got["step"]) == ("hf-trainer", 3)
    assert rewind(["replicate", run_name, "--to", f"s3://{BUCKET}/hf-{run_name}"]) == 0
    shutil.rmtree(tmp_path / "cut")

    done = verified_directory(Catalog(), run_name)  # every byte checked before Trainer unpickles a thing
    assert done.fetched and done.step == 3
    resumed = _trainer(tmp_path / "cut")
    resumed.train(resume_from_checkpoint=str(done.directory))
    a, b = reference.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    bad = tmp_path / "ref" / "checkpoint-6"
    assert _adopt(capsys, str(bad), "--run", f"{run_name}-t")["step"] == 6
    flip(bad / "optimizer.pt")
    capsys.readouterr()
    assert rewind(["ckpt", "restore", f"{run_name}-t"]) == 2
    assert "digest_mismatch" in capsys.readouterr().err


def test_retention_never_deletes_an_adopted_directory(rewind_env, run_name, tmp_path):
    """Adopted checkpoints are pinned and their directories the user's: a roll-back past them and a gc
    with no grace period leave every byte where it was."""
    from safetensors.torch import save_file

    from rewind.infra import retention
    from rewind.infra.inventory.adopt import adopt

    cat = Catalog()
    dirs = []
    for step in (100, 200, 300):
        d = tmp_path / "hf" / f"checkpoint-{step}"
        d.mkdir(parents=True)
        save_file({"w": torch.full((2,), float(step))}, str(d / "model.safetensors"))
        adopt(cat, d, run=run_name)
        dirs.append(d)
    lineage.supersede_after(cat, lineage.get_run(cat, run_name).id, 100, "rolled back")
    with cat.session() as s:  # unpinned behind Rewind's back: still not Rewind's to delete
        for ck in lineage.checkpoints(cat, run_name, 200):
            s.get(type(ck), ck.id).pinned = False
    policy = retention.Policy(keep_last=1, grace_s=0)
    retention.execute(cat, retention.plan(cat, run_name, policy), policy)
    assert all((d / "model.safetensors").exists() for d in dirs)


def _hf_dir(root: Path, name: str, global_step: object = None) -> Path:
    """A directory HF Trainer could have written: weights, and its state naming ``global_step``."""
    from safetensors.torch import save_file

    d = root / name
    d.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(d / "model.safetensors"))
    if global_step is not None:
        (d / "trainer_state.json").write_text(json.dumps({"global_step": global_step}))
    return d


@pytest.mark.parametrize(
    ("name", "global_step"),
    [("final", -1), ("final", 1e19), ("final", 12.9), ("final", True), ("step-9999999999999999999", None)],
    ids=["negative", "float-huge", "fraction", "bool", "name-too-large"],
)
def test_adopt_refuses_a_step_no_checkpoint_can_hold_and_writes_nothing(
    rewind_env, run_name, tmp_path, capsys, name, global_step
):
    """The step a directory's name or trainer_state.json gives is checked before anything is written, so a
    corrected adoption (``--step``) of the same directory goes through."""
    d = _hf_dir(tmp_path, name, global_step if global_step is not None else 5)
    if global_step is None:
        (d / "trainer_state.json").unlink()
    capsys.readouterr()
    assert rewind(["adopt", str(d), "--run", run_name]) == 2
    err = capsys.readouterr().err
    assert "not a whole number from 0 to" in err and "Traceback" not in err
    assert not (d / "manifest.json").exists()
    assert _adopt(capsys, str(d), "--run", run_name, "--step", "5")["step"] == 5


def test_adopt_refuses_a_directory_still_being_written(rewind_env, run_name, tmp_path, capsys, monkeypatch):
    """A file written to while adoption hashes it, or a DCP directory without its last file (.metadata),
    is refused in one line with nothing written; adopted once the writer is done."""
    from rewind.infra.inventory import adopt as adopt_mod

    model, opt = _model(0)
    d = tmp_path / "step-4"
    dcp.save(_state(model, opt), checkpoint_id=str(d))
    metadata = (d / ".metadata").read_bytes()
    (d / ".metadata").unlink()
    capsys.readouterr()
    assert rewind(["adopt", str(d), "--run", run_name, "--format", "dcp"]) == 2
    assert "has no .metadata" in capsys.readouterr().err
    (d / ".metadata").write_bytes(metadata)

    real_hash = adopt_mod.hash_file
    shard = next(d.glob("*.distcp"))

    def writer_still_at_work(p: Path):  # type: ignore[no-untyped-def]
        got = real_hash(p)
        if p == shard:
            with open(p, "ab") as f:  # the writer's next bytes land while adoption hashes
                f.write(b"more")
        return got

    monkeypatch.setattr(adopt_mod, "hash_file", writer_still_at_work)
    assert rewind(["adopt", str(d), "--run", run_name]) == 2
    assert "changed while it was hashed" in capsys.readouterr().err
    assert not (d / "manifest.json").exists()
    monkeypatch.setattr(adopt_mod, "hash_file", real_hash)
    with open(shard, "r+b") as f:  # the writer finished: the file as it was
        f.truncate(shard.stat().st_size - 4)
    assert _adopt(capsys, str(d), "--run", run_name)["step"] == 4


def test_adopt_names_why_a_manifest_json_is_in_the_way(rewind_env, run_name, tmp_path, capsys):
    d = _hf_dir(tmp_path, "checkpoint-3", 3)
    (d / "manifest.json").write_text('{"tool": "someone else\'s"}')
    capsys.readouterr()
    assert rewind(["adopt", str(d), "--run", run_name]) == 2
    assert "another tool's file" in capsys.readouterr().err
    (d / "manifest.json").unlink()
    (d / "sub").mkdir()
    (d / "sub" / "manifest.json").write_text("{}")
    assert rewind(["adopt", str(d), "--run", run_name]) == 2
    assert "has the name of Rewind's manifest" in capsys.readouterr().err
