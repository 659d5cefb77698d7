"""Integrity through the Prefect flows: a lost node restored from the shared tier by the restore-checkpoint
flow, a retention plan made before a roll-back that cannot delete what the roll-back chose, and the
adoption flow taking each new checkpoint directory once."""

from __future__ import annotations

import json

import torch

from rewind.examples.tiny_lm import command
from rewind.flows.cli import main as rewind
from rewind.infra import retention
from rewind.infra.catalog import jobs, lineage
from rewind.infra.catalog.db import Catalog
from tests.integrity_support import statuses
from tests.trainproc import REPO, TrainProc, assert_same_weights

# 2 -------------------------------------------------------------------------------------------


def test_node_loss_is_restored_from_the_shared_tier(reference, prefect_api, rewind_env, run_name, tmp_path):
    import shutil

    from rewind.flows.maintenance import restore_checkpoint_flow

    first = TrainProc(run_name, tmp_path / "out", extra=["--stop-after", "35"])
    assert first.finish() and first.proc.returncode == 0
    assert rewind(["replicate", run_name, "--to", str(tmp_path / "shared")]) == 0
    shutil.rmtree(rewind_env["REWIND_CHECKPOINT_ROOT"])  # the node is gone, and its disk with it

    jobs.set_spec(Catalog(), run_name, {"command": command(run_name, tmp_path / "out"), "cwd": str(REPO)})
    state = restore_checkpoint_flow(run=run_name, relaunch=True, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["step"] == 30 and result["fetched"] and result["source"] == "shared"
    assert result["relaunch"] == "exited with code 0", result
    assert "corrupt" not in statuses(run_name).values()
    assert_same_weights(tmp_path / "out" / "final.safetensors", reference[1])


# 7 -------------------------------------------------------------------------------------------


def test_gc_plan_made_before_a_rollback_keeps_what_it_chose(
    reference, prefect_api, rewind_env, run_name, tmp_path
):
    from rewind.flows.maintenance import restore_checkpoint_flow

    first = TrainProc(run_name, tmp_path / "out", extra=["--stop-after", "35"])
    assert first.finish() and first.proc.returncode == 0
    assert rewind(["ckpt", "verify", run_name, "--deep"]) == 0
    cat = Catalog()
    policy = retention.Policy(keep_last=1)
    gc = retention.plan(cat, run_name, policy)  # made now: keeps 30, would remove 10 and 20
    assert gc.keep == [30] and sorted(r.step for r in gc.remove) == [10, 20]

    state = restore_checkpoint_flow(run=run_name, step=20, return_state=True)  # a roll-back to step 20
    assert state.is_completed(), state.message

    assert retention.execute(cat, gc, policy) == [10]  # step 20 is the newest verified now: refused
    assert statuses(run_name) == {10: "deleted", 20: "verified", 30: "superseded"}
    second = TrainProc(run_name, tmp_path / "out")
    out = second.finish()
    assert second.proc.returncode == 0 and out.resumed_at == 20, out.text
    assert_same_weights(tmp_path / "out" / "final.safetensors", reference[1])


def test_adopt_flow_takes_each_new_checkpoint_once(prefect_api, rewind_env, run_name, tmp_path):
    """Adoption as a flow (the UI form, or a schedule watching an HF Trainer output_dir)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from safetensors.torch import save_file

    from rewind.flows.maintenance import adopt_checkpoints, verify_checkpoints
    from rewind.tasks.common import artifact_key

    out = tmp_path / "trainer_out"

    def hf_checkpoint(
        step: int, *, finished: bool = True
    ) -> None:  # HF Trainer writes trainer_state.json last
        (out / f"checkpoint-{step}").mkdir(parents=True)
        save_file({"w": torch.full((4,), float(step))}, str(out / f"checkpoint-{step}" / "model.safetensors"))
        if finished:
            (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))

    hf_checkpoint(500)
    hf_checkpoint(1000)
    hf_checkpoint(1500, finished=False)  # still being written: left for the next run
    assert adopt_checkpoints(path=str(out), run=run_name, quiet_s=0) == {"adopted": [500, 1000], "checked": 2}
    assert adopt_checkpoints(path=str(out), run=run_name, quiet_s=0) == {"adopted": [], "checked": 0}
    (out / "checkpoint-1500" / "trainer_state.json").write_text(json.dumps({"global_step": 1500}))
    assert adopt_checkpoints(path=str(out), run=run_name, quiet_s=0)["adopted"] == [1500]
    rows = {c.step: c for c in lineage.checkpoints(Catalog(), run_name)}
    assert rows[1500].parent_id == rows[1000].id and rows[1000].parent_id == rows[500].id
    assert verify_checkpoints(run=run_name) == {"checked": 3, "unchecked": 0, "corrupt": 0, "drift": 0}
    with get_client(sync_client=True) as client:  # the scrub refreshed the status overview
        (status,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[artifact_key("rewind", run_name, "status")])
            ),
            limit=1,
        )
    assert f"run {run_name}" in status.data and "newest verified   step 1500" in status.data, status.data


def test_the_adoption_watcher_never_follows_a_link_out_of_the_folder_it_watches(
    prefect_api, rewind_env, run_name, tmp_path
):
    """A `checkpoint-*` link to a directory elsewhere: adopting would write a manifest there."""
    from safetensors.torch import save_file

    from rewind.flows.maintenance import adopt_checkpoints

    out, elsewhere = tmp_path / "trainer_out", tmp_path / "someone-elses" / "checkpoint-900"
    for d, step in ((out / "checkpoint-500", 500), (elsewhere, 900)):
        d.mkdir(parents=True)
        save_file({"w": torch.full((4,), float(step))}, str(d / "model.safetensors"))
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (out / "checkpoint-900").symlink_to(elsewhere, target_is_directory=True)
    assert adopt_checkpoints(path=str(out), run=run_name, quiet_s=0) == {"adopted": [500], "checked": 1}
    assert sorted(p.name for p in elsewhere.iterdir()) == ["model.safetensors", "trainer_state.json"]
