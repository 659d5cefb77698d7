"""The Rewind story in one command (``make demo``), through the Prefect flows, on embedded defaults.

1. train tiny_lm without interruption: the reference;
2. `protect-training` runs it again under watch, verifying each checkpoint; the
   training process is SIGKILLed in the middle of its step-40 save (through the
   documented ``REWIND_FAULT`` seam, so the crash lands at the same place on a
   fast or a slow machine) and the flow records an incident;
3. one byte of the newest checkpoint is flipped;
4. `recover-training` (what `rewind serve`'s automation starts on the failure
   event) chooses the newest checkpoint (its manifest proven) and relaunches the job,
   which hashes every byte it loads, refuses the damaged checkpoint and loads the one
   before; the flow watches it to the end;
5. `verify-checkpoints` scrubs the run;
6. a report: checkpoints and lineage, what was skipped and why, the incident's
   RTO breakdown, the flow runs, and whether the final weights equal the
   uninterrupted run's bit for bit.

Prefect's ephemeral server is used unless PREFECT_API_URL points at a server.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 60, 10
KILL_AT = 40  # a save that never completes: the newest checkpoint stays at 30


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def say_refusal(cat: Any, incident_id: int) -> None:
    """The damaged restore point, refused: recover-training proves the newest checkpoint's manifest, and the
    relaunched job, hashing every byte as it loads, refuses the flipped bit and falls back."""
    from rewind.infra.catalog import incidents, lineage

    inc = incidents.get_incident(cat, incident_id)
    refused = (inc.details or {}).get("restore_point_refused")
    loaded = (inc.details or {}).get("restored_by_job") or {}
    if refused is None:
        say("the damaged checkpoint was not chosen by the recovery (an older one was)")
        return
    bad = lineage.get_checkpoint(cat, int(refused)).step
    say(f"refused, as it must be: step {bad} failed the job's check of every byte it read; it loaded step "
        f"{loaded.get('step')} instead")  # fmt: skip


def tiny_lm(run: str, out: Path) -> list[str]:
    from rewind.examples.tiny_lm import command

    return command(run, out, steps=STEPS, every=EVERY, seed=0)


def _protect_until_killed(run: str, work: Path) -> int:
    """protect-training with the job SIGKILLed inside its step-``KILL_AT`` save; the incident it recorded."""
    from rewind.flows.training import protect_training, summary

    result: dict = {}
    os.environ["REWIND_FAULT"] = f"kill:save.file_written@{KILL_AT}"  # inherited by the training process only
    flow_thread = threading.Thread(
        target=lambda: result.update(
            summary(protect_training(run, tiny_lm(run, work / "run"), str(REPO), return_state=True))
        ),
        daemon=True,
    )
    flow_thread.start()
    flow_thread.join(timeout=300)
    os.environ.pop("REWIND_FAULT")  # the relaunch must not crash again
    if "incident_id" not in result:
        raise SystemExit(f"demo: protect-training did not record an incident: {result}")
    say(f"protect-training recorded incident {result['incident_id']}: {result}")
    return int(result["incident_id"])


def _flip_a_bit(cat: Any, run: str) -> Path:
    """One bit of the newest restorable checkpoint's model file flipped; the file."""
    from rewind.infra.catalog import lineage

    newest = lineage.restorable(cat, lineage.get_run(cat, run).id)[0]
    target = Path(newest.path) / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    return target


def _same_weights(work: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    ta = load_file(str(work / "run" / "final.safetensors"))
    tb = load_file(str(work / "reference" / "final.safetensors"))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _report(cat: Any, run: str, incident_id: int, began: datetime) -> None:
    """The run's checkpoints, the incident's phases, the demo's flow runs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    from rewind.infra.catalog import incidents, lineage

    print("\n=== Rewind demo report ===")
    rows = lineage.checkpoints(cat, run)
    by_id = {c.id: c for c in rows}
    print(f"{'step':>5}  {'status':10} {'parent':>6}  {'bytes':>9}  {'stall_s':>7}  reason")
    for c in rows:
        parent = by_id[c.parent_id].step if c.parent_id in by_id else "-"
        stall = f"{c.save_stall_s:.3f}" if c.save_stall_s is not None else "-"
        print(
            f"{c.step:>5}  {c.status:10} {parent!s:>6}  {c.total_bytes or 0:>9}  {stall:>7}  {c.status_reason or ''}"
        )
    inc = incidents.get_incident(cat, incident_id)
    print(f"\nincident {inc.id} ({inc.kind}): {inc.reason}")
    print(f"  decision: {inc.decision}")
    print(
        f"  detection {inc.detection_s:.3f}s | restore (verify) {inc.load_s:.2f}s | relaunch to first step {inc.rebuild_s:.2f}s"
    )
    print(f"  replayed {inc.replayed_steps} steps | RTO (death to first step after restore) {inc.rto_s:.2f}s")
    with get_client(sync_client=True) as client:
        print("\nflow runs of this demo:")
        mine = FlowRunFilter(start_time=FlowRunFilterStartTime(after_=began))
        for fr in sorted(client.read_flow_runs(flow_run_filter=mine), key=lambda r: r.created):
            flow_name = client.read_flow(fr.flow_id).name
            print(f"  {flow_name:20} {fr.name:28} {fr.state.type.value if fr.state else '?'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}", help="run name")
    args = p.parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_TASKS_DEFAULT_NO_CACHE", "true")
    # The first start of the ephemeral server migrates its database: give a busy machine time.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

    from prefect.client.orchestration import get_client

    from rewind.examples.runner import TrainingProcess
    from rewind.flows.maintenance import verify_checkpoints
    from rewind.flows.training import recover_training, summary
    from rewind.infra import config
    from rewind.infra.catalog.db import Catalog

    cat = Catalog()
    work = config.home() / "demo" / args.name
    run = args.name
    t0, began = time.monotonic(), datetime.now(UTC)
    say(f"catalog {cat.safe_url}; checkpoints under {config.checkpoint_root()}")

    say("1/5 reference: 60 uninterrupted steps")
    ref = TrainingProcess(tiny_lm(f"{run}-reference", work / "reference"), cwd=REPO)
    if ref.finish(timeout=300) != 0:
        raise SystemExit(ref.output.text[-2000:])

    say("starting Prefect (ephemeral server unless PREFECT_API_URL is set)")
    with get_client(sync_client=True) as client:
        client.hello()
    say(f"2/5 protect-training flow; the training process will be SIGKILLed inside its step-{KILL_AT} save")
    incident_id = _protect_until_killed(run, work)
    say(f"3/5 flipped one bit in {_flip_a_bit(cat, run)}")

    say("4/5 recover-training (in `rewind serve` the failure event starts it by itself)")
    recovered = summary(recover_training(incident_id, return_state=True))
    say_refusal(cat, incident_id)
    say(f"recover-training: {recovered}")
    say("5/5 verify-checkpoints (scheduled scrub)")
    scrub = verify_checkpoints(run=run, return_state=True)
    say(f"verify-checkpoints: {scrub.type.value}" + (f": {scrub.message}" if scrub.message else ""))

    equal = _same_weights(work)
    _report(cat, run, incident_id, began)
    print(f"\nfinal weights bit-identical to the uninterrupted run: {equal}")
    print(f"demo took {time.monotonic() - t0:.1f}s")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
