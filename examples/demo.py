"""The Rewind story in one command (``make demo``), through the Prefect flows, on embedded defaults.

1. train tiny_lm without interruption: the reference;
2. `protect-training` runs it again under watch, verifying each checkpoint; the
   demo SIGKILLs the training process mid-run and the flow records an incident;
3. one byte of the newest checkpoint is flipped;
4. `recover-training` (what `rewind serve`'s automation starts on the failure
   event) refuses the damaged checkpoint, restores the one before, relaunches the
   job and watches it to the end;
5. `verify-checkpoints` scrubs the run;
6. a report: checkpoints and lineage, what was skipped and why, the incident's
   RTO breakdown, the flow runs, and whether the final weights equal the
   uninterrupted run's bit for bit.

Prefect's ephemeral server is used unless PREFECT_API_URL points at a server.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 60, 10


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def tiny_lm(run: str, out: Path) -> list[str]:
    from examples.tiny_lm import command

    return command(run, out, steps=STEPS, every=EVERY, seed=0)


def wait_until(probe, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (got := probe()):
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what}")
        time.sleep(0.2)
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}", help="run name")
    args = p.parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_TASKS_DEFAULT_NO_CACHE", "true")
    # The first start of the ephemeral server migrates its database: give a busy machine time.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

    import torch
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from safetensors.torch import load_file

    from flows.maintenance import verify_checkpoints
    from flows.training import protect_training, recover_training
    from infra import config
    from infra.catalog import incidents, lineage
    from infra.catalog.db import Catalog
    from infra.launch.process import TrainingProcess, find_pids

    cat = Catalog()
    work = config.home() / "demo" / args.name
    run = args.name
    t0 = time.monotonic()
    say(f"catalog {cat.safe_url}; checkpoints under {config.checkpoint_root()}")

    say("1/5 reference: 60 uninterrupted steps")
    ref = TrainingProcess(tiny_lm(f"{run}-reference", work / "reference"), cwd=REPO)
    if ref.finish(timeout=300) != 0:
        raise SystemExit(ref.output.text[-2000:])

    say("starting Prefect (ephemeral server unless PREFECT_API_URL is set)")
    with get_client(sync_client=True) as client:
        client.hello()
    say("2/5 protect-training flow; the training process will be SIGKILLed after step 35")
    result: dict = {}
    flow_thread = threading.Thread(
        target=lambda: result.update(protect_training(run, tiny_lm(run, work / "run"), str(REPO))),
        daemon=True,
    )
    flow_thread.start()
    run_id = wait_until(lambda: _run_id(lineage, cat, run), 120, "the run")
    wait_until(lambda: any(c.step >= 30 for c in lineage.restorable(cat, run_id)), 180, "checkpoint 30")
    wait_until(
        lambda: any(c.step == 30 and c.status == "verified" for c in lineage.checkpoints(cat, run)),
        60,
        "verification of 30",
    )
    pid = wait_until(lambda: find_pids("examples.tiny_lm", f"--run {run} "), 10, "the training process")[0]
    os.kill(pid, signal.SIGKILL)
    say(f"SIGKILLed training pid {pid}")
    flow_thread.join(timeout=120)
    incident_id = result["incident_id"]
    say(f"protect-training recorded incident {incident_id}: {result}")

    newest = lineage.restorable(cat, run_id)[0]
    target = Path(newest.path) / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    say(f"3/5 flipped one bit in {target}")

    say("4/5 recover-training (in `rewind serve` the failure event starts it by itself)")
    recovered = recover_training(incident_id)
    say(f"recover-training: {recovered}")
    say("5/5 verify-checkpoints (scheduled scrub)")
    scrub = verify_checkpoints(run=run, return_state=True)
    say(f"verify-checkpoints: {scrub.type.value} {scrub.message or ''}")

    ta = load_file(str(work / "run" / "final.safetensors"))
    tb = load_file(str(work / "reference" / "final.safetensors"))
    equal = ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)

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
        print("\nflow runs:")
        for fr in sorted(client.read_flow_runs(flow_run_filter=FlowRunFilter()), key=lambda r: r.created):
            flow_name = client.read_flow(fr.flow_id).name
            print(f"  {flow_name:20} {fr.name:28} {fr.state.type.value if fr.state else '?'}")
    print(f"\nfinal weights bit-identical to the uninterrupted run: {equal}")
    print(f"demo took {time.monotonic() - t0:.1f}s")
    return 0 if equal else 1


def _run_id(lineage, cat, name: str):  # type: ignore[no-untyped-def]
    try:
        return lineage.get_run(cat, name).id
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
