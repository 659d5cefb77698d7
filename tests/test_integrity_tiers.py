"""Integrity across tiers and ranks, with real training processes: a forged DCP .metadata never runs
(2 ranks, gloo), the local and shared tiers lost together, every copy of the newest checkpoint damaged."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from rewind.examples.runner import TrainingProcess
from rewind.examples.tiny_lm import command
from rewind.flows.cli import main as rewind
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_file, manifest_digest
from tests.integrity_support import copy_statuses, flip
from tests.s3_support import BUCKET
from tests.trainproc import REPO, TrainProc, assert_same_weights

# 1 -------------------------------------------------------------------------------------------


class _Payload:
    """What an attacker puts in .metadata: unpickling it runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, (f"touch {self.marker}",))


def _forge_metadata(step_dir: Path, marker: Path, *, catalog: bool, run: str, step: int) -> None:
    """Replace DCP's .metadata by a pickle that runs code; fix the manifest's entry (and the catalog's digest)."""
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    body = json.loads((step_dir / mf.MANIFEST_NAME).read_text())
    d = hash_file(step_dir / ".metadata")
    for f in body["files"]:
        if f["path"] == ".metadata":
            f.update(size=d.size, xxh3=d.xxh3, crc32c=d.crc32c)
    raw = (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()
    (step_dir / mf.MANIFEST_NAME).write_bytes(raw)
    if catalog:  # the stronger attacker, who can also write the catalog
        cat = Catalog()
        (ck,) = [c for c in lineage.checkpoints(cat, run, step) if c.status in ("committed", "verified")]
        with cat.session() as s:
            s.get(type(ck), ck.id).manifest_digest = manifest_digest(raw)


# Two ranks: rank 0 leads the restore, a follower loads the same forged checkpoint; more ranks (each one
# a process importing torch) only add start-up time.
RANKS = 2


def _ddp(run: str, out: Path, steps: int, dumps: Path) -> TrainingProcess:
    cmd = command(
        run, out, steps=steps, every=5, extra=["--nproc", str(RANKS)], module="rewind.examples.tiny_lm_ddp"
    )
    return TrainingProcess(cmd, cwd=REPO, env={"OMP_NUM_THREADS": "1", "TINY_LM_DUMP_DIR": str(dumps)})


def test_forged_dcp_metadata_never_runs(rewind_env, run_name, tmp_path):
    root, dumps = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "dumps"
    first = _ddp(run_name, tmp_path / "out", 15, dumps)
    assert first.finish(timeout=300) == 0, first.output.text[-3000:]
    _forge_metadata(root / run_name / "step-15", tmp_path / "ran-15", catalog=False, run=run_name, step=15)
    _forge_metadata(root / run_name / "step-10", tmp_path / "ran-10", catalog=True, run=run_name, step=10)

    second = _ddp(run_name, tmp_path / "out", 20, dumps)
    assert second.finish(timeout=300) == 0, second.output.text[-3000:]
    assert f"at step 5 on {RANKS} ranks" in second.output.text, second.output.text[-3000:]
    assert not (tmp_path / "ran-15").exists() and not (tmp_path / "ran-10").exists()  # no code ran
    text = second.output.text
    skipped = {
        int(line.split()[3].rstrip(":")): line for line in text.splitlines() if "rewind: skipped step" in line
    }
    assert "not the manifest the catalog recorded" in skipped[15]  # the manifest was edited: refused first
    assert "refuses to unpickle posix.system" in skipped[10], skipped  # catalog forged too: the unpickler
    cat = Catalog()  # both refused, then superseded by the saves that followed
    old = [c for c in lineage.checkpoints(cat, run_name) if c.step in (10, 15) and c.status == "superseded"]
    assert sorted(c.step for c in old) == [10, 15]
    saved, restored = (
        load_file(str(dumps / "saved-5.safetensors")),
        load_file(str(dumps / "restored-5.safetensors")),
    )
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)


# 13, 14 --------------------------------------------------------------------------------------


def _train_and_replicate(run: str, out: Path, shared: Path, offsite: str) -> None:
    first = TrainProc(run, out, extra=["--stop-after", "35"])
    assert first.finish() and first.proc.returncode == 0
    assert rewind(["replicate", run, "--to", str(shared)]) == 0
    assert rewind(["replicate", run, "--to", offsite]) == 0


def test_local_and_shared_tiers_lost_restore_from_s3(reference, s3_env, rewind_env, run_name, tmp_path):
    root, shared = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "shared"
    _train_and_replicate(run_name, tmp_path / "out", shared, f"s3://{BUCKET}/lost-{run_name}")
    shutil.rmtree(root)  # the node and its disk
    shutil.rmtree(shared)  # and the shared filesystem with it

    second = TrainProc(run_name, tmp_path / "out")
    out = second.finish()
    assert second.proc.returncode == 0 and out.resumed_at == 30, out.text
    assert all(reference[0][s] == loss for s, loss in out.losses.items())
    assert_same_weights(tmp_path / "out" / "final.safetensors", reference[1])
    assert copy_statuses(run_name, 30) == {
        "local": "verified",
        "shared": "unverifiable",
        "offsite": "verified",
    }


def test_every_copy_of_the_newest_damaged_falls_back(reference, s3_env, rewind_env, run_name, tmp_path):
    root, shared = Path(rewind_env["REWIND_CHECKPOINT_ROOT"]), tmp_path / "shared"
    prefix = f"damaged-{run_name}"
    _train_and_replicate(run_name, tmp_path / "out", shared, f"s3://{BUCKET}/{prefix}")
    flip(root / run_name / "step-30" / "model.safetensors")
    flip(shared / run_name / "step-30" / "optimizer.safetensors")
    key = f"{prefix}/{run_name}/step-30/model.safetensors"  # rewritten behind Rewind's back, no checksum
    client = s3_env.client()
    body = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[len(body) // 3] ^= 0x01
    client.delete_object(Bucket=BUCKET, Key=key)
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))

    second = TrainProc(run_name, tmp_path / "out")
    out = second.finish()
    assert second.proc.returncode == 0 and out.resumed_at == 20, out.text
    assert all(reference[0][s] == loss for s, loss in out.losses.items())
    assert_same_weights(tmp_path / "out" / "final.safetensors", reference[1])
    dead = [c for c in lineage.checkpoints(Catalog(), run_name, 30) if c.status in ("corrupt", "superseded")]
    assert dead and {r.tier: r.status for r in lineage.replicas_of(Catalog(), dead[0].id)} == {
        "local": "corrupt",
        "shared": "corrupt",
        "offsite": "corrupt",
    }
