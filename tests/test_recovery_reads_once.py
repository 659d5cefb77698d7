"""A recovery hands the job the restore point it chose, and the restore point's bytes are read once between
the failure and the first step: the flow proves the manifest against the catalog, the job hashes every
byte as it loads (counted by both, recorded on the incident)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from rewind.examples.tiny_lm import command
from rewind.infra.catalog import incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from tests.prefect_support import wait_until
from tests.trainproc import REPO, assert_same_weights


def _pid_past(cat: Catalog, run: str, step: int) -> int:
    def probe() -> int | None:
        try:
            launches = jobs.launches(cat, run)
        except Exception:  # the run is not in the catalog yet
            return None
        rows = jobs.progress(cat, launches[-1].id) if launches else []
        return rows[0].pid if rows and (rows[0].step or 0) >= step else None

    return wait_until(probe, 120, f"the job past step {step}", interval=0.1)


def _killed_at_25(cat: Catalog, run: str, out: Path) -> dict[str, Any]:
    """The example job under protect-training, SIGKILLed past step 25 (checkpoints at 10 and 20)."""
    from rewind.flows.training import protect_training, summary

    cmd = command(run, out, steps=60, every=10, extra=["--step-time-s", "0.05"])
    result: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(summary(protect_training(run, cmd, str(REPO), return_state=True)))
    )
    t.start()
    os.kill(_pid_past(cat, run, 25), signal.SIGKILL)
    t.join(timeout=120)
    assert result["status"] == "crash", result
    return result


def test_a_recovery_loads_the_checkpoint_the_incident_names_reading_its_bytes_once(
    prefect_api: str, rewind_env: dict[str, str], reference: Any, run_name: str, tmp_path: Path
) -> None:
    from rewind.flows.training import recover_training, summary

    cat = Catalog()
    out = tmp_path / "out"
    result = _killed_at_25(cat, run_name, out)

    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered
    assert_same_weights(out / "final.safetensors", reference[1])

    inc = incidents.get_incident(cat, result["incident_id"])
    chosen = lineage.get_checkpoint(cat, inc.restored_checkpoint_id)
    by_job = inc.details["restored_by_job"]
    assert by_job["checkpoint_id"] == chosen.id and by_job["step"] == chosen.step, (by_job, chosen.step)
    assert "restore_point_refused" not in inc.details
    # Every byte of the restore point read once: by the job, hashing as it loads. The flow proved the
    # manifest and read only the small training-state file (the data loader's position) of it.
    tensors = sum(f.size for f in lineage.files_of(cat, chosen.id) if f.path.endswith(".safetensors"))
    assert by_job["bytes_read"] == chosen.total_bytes, (by_job, chosen.total_bytes)
    by_flow = inc.details["restore_bytes_read_by_flow"]
    assert by_flow <= chosen.total_bytes - tensors, (by_flow, chosen.total_bytes, tensors)
    launch = jobs.launches(cat, run_name)[-1]
    assert launch.handoff["restore"] == {
        "checkpoint_id": chosen.id,
        "step": chosen.step,
        "manifest_digest": chosen.manifest_digest,
    }


def test_with_only_a_shared_copy_left_the_flow_reads_its_state_and_the_job_fetches_the_rest_once(
    prefect_api: str, rewind_env: dict[str, str], reference: Any, run_name: str, tmp_path: Path
) -> None:
    """The local copies gone, the restore point on the shared tier only: the flow does not download it
    (the job may run on other hosts, and would read it again); it proves the manifest there and reads the
    training state; the job fetches every byte, hashing it, and ends bit-exact."""
    import shutil

    from rewind.flows.training import recover_training, summary
    from rewind.infra.replication import replicate
    from rewind.infra.tiers import open_tier

    cat = Catalog()
    out = tmp_path / "out"
    result = _killed_at_25(cat, run_name, out)
    (tmp_path / "shared").mkdir()
    shared = open_tier(str(tmp_path / "shared"))
    for ck in lineage.restorable(cat, lineage.get_run(cat, run_name).id):
        replicate(cat, ck, shared)
        shutil.rmtree(ck.path)  # the local disk lost them

    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered", recovered
    assert_same_weights(out / "final.safetensors", reference[1])
    inc = incidents.get_incident(cat, result["incident_id"])
    chosen = lineage.get_checkpoint(cat, inc.restored_checkpoint_id)
    tensors = sum(f.size for f in lineage.files_of(cat, chosen.id) if f.path.endswith(".safetensors"))
    assert inc.details["restore_bytes_read_by_flow"] <= chosen.total_bytes - tensors, inc.details
    assert inc.details["restored_by_job"]["bytes_read"] >= chosen.total_bytes, inc.details


def test_when_every_restore_point_fails_as_the_job_reads_it_the_job_refuses_to_start_over(
    prefect_api: str, rewind_env: dict[str, str], run_name: str, tmp_path: Path
) -> None:
    """The flow proved only manifests, so the damage shows when the job hashes the bytes: it must not
    train from scratch (that would lose the run), and the incident must say the restore failed."""
    from rewind.flows.training import recover_training, summary
    from tests.integrity_support import flip

    cat = Catalog()
    result = _killed_at_25(cat, run_name, tmp_path / "out")
    for ck in lineage.restorable(cat, lineage.get_run(cat, run_name).id):
        flip(next(Path(ck.path).glob("model*.safetensors")))  # sizes and manifests still match

    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "failed-again", recovered
    first = incidents.get_incident(cat, result["incident_id"])
    assert "restore_failed_in_job" in first.details and first.resolved_at is None, first.details
    again = incidents.get_incident(cat, recovered["incident_id"])
    assert again.kind == "failed_to_start" and "could not load its restore point" in again.reason, (
        again.reason
    )
    relaunch = jobs.progress(cat, jobs.launches(cat, run_name)[-1].id)
    assert all((r.step or 0) == 0 for r in relaunch), [
        (r.rank, r.step) for r in relaunch
    ]  # not one step trained
    assert not (tmp_path / "out" / "final.safetensors").exists()
