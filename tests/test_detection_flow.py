"""A rank that stops stepping is detected by its heartbeat silence, recorded, and the job stopped."""

from __future__ import annotations

from infra.catalog import incidents
from infra.catalog.db import Catalog
from tests.trainproc import REPO


def ddp_command(run: str, out, **kw) -> list[str]:  # type: ignore[no-untyped-def]
    from examples.tiny_lm import command

    return command(run, out, module="examples.tiny_lm_ddp", **kw)


def test_hung_rank_is_detected_within_its_heartbeat_timeout(
    prefect_api, rewind_env, run_name, tmp_path, monkeypatch
):
    from flows.training import protect_training

    monkeypatch.setenv("REWIND_HANG_AT_STEP", "8")
    monkeypatch.setenv("REWIND_HANG_RANK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    command = ddp_command(run_name, tmp_path / "out", steps=30, every=5, extra=["--nproc", "2"])
    timeout, poll = 5.0, 1.0
    result = protect_training(run_name, command, str(REPO), heartbeat_timeout_s=timeout)
    assert result["status"] == "hang", result
    (inc,) = incidents.incidents_of(Catalog(), run_name)
    assert inc.kind == "hang" and inc.details["hang"]["step"] == 7
    # Silence can only be noticed once it passes the timeout, and is checked every poll interval.
    assert timeout <= inc.detection_s <= timeout + 3 * poll, inc.detection_s
    print(f"\nHANG detected after {inc.detection_s:.2f}s of silence (timeout {timeout}s): {inc.reason}")


def test_nan_rolls_back_before_the_anomaly_and_skips_the_data_window(
    prefect_api, rewind_env, run_name, tmp_path, monkeypatch
):
    import json

    from examples.tiny_lm_model import CharDataset, corpus
    from flows.training import protect_training, recover_training
    from infra.catalog import lineage
    from infra.training.data import epoch_order

    order = epoch_order(len(CharDataset(corpus(), 32)), 0, 0).tolist()
    poison = order[390]  # global position 390: step 13 with 2 ranks x 16 samples
    monkeypatch.setenv("REWIND_POISON_SAMPLE", str(poison))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    log = tmp_path / "samples"
    log.mkdir()
    command = ddp_command(
        run_name, tmp_path / "out", steps=24, every=5, extra=["--nproc", "2", "--sample-log", str(log)]
    )
    result = protect_training(run_name, command, str(REPO))
    assert result["status"] == "nan", result
    for f in log.glob("rank-*.log"):
        f.rename(f.with_suffix(".first"))  # keep the relaunch's log apart
    recovered = recover_training(result["incident_id"])
    assert recovered["status"] == "recovered" and recovered["restored_step"] == 10, recovered
    cat = Catalog()
    inc = incidents.get_incident(cat, result["incident_id"])
    assert inc.kind == "nan" and inc.details["bad_step"] == 13
    assert inc.details["skipped_samples"] == [320, 416] and inc.details["skipped_steps"] == [11, 13]
    assert (tmp_path / "out" / "final.safetensors").exists()
    # After the rollback no rank saw the skipped window again, and the poisoned sample never came back.
    after = [json.loads(x) for f in log.glob("rank-*.log") for x in f.read_text().splitlines()]
    assert sorted({r["step"] for r in after}) == list(range(11, 25))
    seen = {s for r in after for s in r["samples"]}
    assert poison not in seen and not seen & set(order[320:416])
    assert {s for s in order[416 : 416 + 14 * 32]} == seen
    steps = {
        c.step: c.status
        for c in lineage.checkpoints(cat, run_name)
        if c.step > 10 and c.status != "committed"
    }
    assert all(st in ("superseded", "verified") for st in steps.values()), steps
