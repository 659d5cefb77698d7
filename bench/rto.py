"""Recovery in seconds: the RTO of a SIGKILLed job with warm relaunch (a standby takes it over) against cold
(a new interpreter), through Rewind's own flows, and goodput under three kills; all in the same run.

    .venv/bin/python -m bench.rto [--kills 10] [--seed S] [--goodput-steps 600]

RTO: the example job (``rewind.examples.tiny_lm``, 100 steps, a checkpoint every 10, 0.1 s a step) runs
under ``protect-training``; it is SIGKILLed at a seeded step between 45 and 75 (the warm run's standby
answering by then: it is made once the job trains) and ``recover-training``
brings it back; the RTO is the incident's (the failure to the relaunch's first step), with its phases
(detect, decide, restore, group-ready/relaunch, first step). The same seeded kill steps for both
policies, alternating warm and cold. Goodput: the same job, 600 steps of 0.1 s with a checkpoint every
30 (3 s), killed at three seeded steps and resumed by Rewind from a standby, over the same job with no
failure (``rewind drill goodput``'s harness). Writes ``rto_warm_s``, ``rto_cold_s``,
``rto_warm_ratio_vs_cold``, ``rto_phases`` and ``goodput_ratio_vs_uninterrupted`` to bench/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STEPS, EVERY, STEP_S = 100, 10, 0.1


def _isolate(work: Path) -> None:
    """Rewind and Prefect confined to ``work`` (a SQLite catalog, Prefect's ephemeral server)."""
    for k in ("PREFECT_API_URL", "PREFECT_PROFILE", "REWIND_CATALOG_URL", "REWIND_CHECKPOINT_ROOT"):
        os.environ.pop(k, None)
    os.environ.update({
        "REWIND_HOME": str(work / "home"), "PREFECT_HOME": str(work / "prefect"), "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "ERROR",
        "PREFECT_TASKS_DEFAULT_NO_CACHE": "true", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "OMP_NUM_THREADS": "1",
    })  # fmt: skip


def _wait(probe: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(f"{what} not within {timeout_s:g} s")


def _pid_past(run: str, step: int) -> int | None:
    from rewind.infra.catalog import jobs
    from rewind.infra.catalog.db import Catalog

    try:
        launch = jobs.launches(Catalog(), run)[-1]
    except Exception:  # not in the catalog yet
        return None
    rows = jobs.progress(Catalog(), launch.id)
    return rows[0].pid if rows and (rows[0].step or 0) >= step else None


def one_recovery(run: str, kill_at: int, warm_relaunch: bool, out: Path) -> dict[str, Any]:
    """One protected run SIGKILLed at ``kill_at`` and recovered; its incident's RTO and phases."""
    from rewind.examples.tiny_lm import command
    from rewind.flows.training import protect_training, recover_training, summary
    from rewind.infra.catalog import incidents, jobs
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.launch import warm

    cmd = command(run, out, steps=STEPS, every=EVERY, extra=["--step-time-s", str(STEP_S)])
    result: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(
            summary(protect_training(run, cmd, str(REPO), warm=warm_relaunch, return_state=True))
        )
    )
    t.start()
    if warm_relaunch:  # a standby in place before the kill: what the measure is of
        _wait(lambda: warm.answering(run, 0), 120, "the standby")
    os.kill(_wait(lambda: _pid_past(run, kill_at), 120, f"step {kill_at}"), signal.SIGKILL)
    t.join(timeout=120)
    recovered = summary(recover_training(result["incident_id"], return_state=True))
    if recovered.get("status") != "recovered":
        raise RuntimeError(f"{run} not recovered: {recovered}")
    cat = Catalog()
    inc = incidents.get_incident(cat, result["incident_id"])
    taken = jobs.launches(cat, run)[-1].handoff.get("warm")
    d = inc.details or {}
    detect, flow = inc.detection_s or 0.0, d.get("flow_start_s") or 0.0
    return {
        "warm": bool(taken and taken[0]), "kill_at": kill_at, "rto_s": inc.rto_s,
        "phases": {"detect": detect, "decide": max(0.0, flow - detect), "restore": inc.load_s,
                   "group_ready": d.get("group_ready_s"), "relaunch_to_first_step": inc.rebuild_s},
    }  # fmt: skip


def rto(kills: int, seed: int, work: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    steps = [rng.randint(45, 75) for _ in range(kills)]
    got: dict[str, list[dict[str, Any]]] = {"warm": [], "cold": []}
    for i, at in enumerate(steps):  # alternating: the machine's drift falls on both alike
        for policy in ("warm", "cold") if i % 2 == 0 else ("cold", "warm"):
            r = one_recovery(f"rto-{policy}-{i}", at, policy == "warm", work / f"out-{policy}-{i}")
            got[policy].append(r)
            print(
                f"  {policy:4} kill at {at:2}: RTO {r['rto_s']:.2f} s (taken over warm: {r['warm']})",
                flush=True,
            )
    warm_s = statistics.median(r["rto_s"] for r in got["warm"])
    cold_s = statistics.median(r["rto_s"] for r in got["cold"])
    phases = {
        policy: {k: round(statistics.median(r["phases"][k] or 0.0 for r in rs), 3) for k in rs[0]["phases"]}
        for policy, rs in got.items()
    }
    return {
        "rto_seed": seed, "rto_kills": kills, "rto_kill_steps": steps,
        "rto_warm_s": round(warm_s, 3), "rto_cold_s": round(cold_s, 3),
        "rto_warm_ratio_vs_cold": round(warm_s / cold_s, 3), "rto_phases": phases,
        "rto_warm_taken_over": sum(r["warm"] for r in got["warm"]),
    }  # fmt: skip


def goodput_warm(steps: int, seed: int) -> dict[str, Any]:
    from rewind.infra.drills.goodput import goodput

    def command(run: str, out: Path, log: Path) -> list[str]:
        return [sys.executable, "-m", "rewind.examples.tiny_lm", "--run", run, "--steps", str(steps),
                "--checkpoint-every", "30", "--seed", "0", "--out", str(out), "--step-time-s", "0.1",
                "--loss-log", str(log)]  # fmt: skip

    got = goodput(command, steps=steps, failures=3, seed=seed, warm_relaunch=True, from_scratch=False)
    return {
        "goodput_ratio_vs_uninterrupted": got["rewind_warm_vs_no_failure"],
        "goodput_cold_ratio_vs_uninterrupted": got["rewind_vs_no_failure"],
        "goodput": {k: got[k] for k in ("seed", "steps", "killed_at_steps", "wall_s", "launches")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10, help="seeded SIGKILLs per policy")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--goodput-steps", type=int, default=600)
    args = p.parse_args(argv)
    seed = random.randrange(1 << 30) if args.seed is None else args.seed
    print(f"seed {seed}")
    work = Path(tempfile.mkdtemp(prefix="rewind-bench-rto-", dir=HERE))
    try:
        _isolate(work)
        results = rto(args.kills, seed, work)
        print(f"RTO median: warm {results['rto_warm_s']} s, cold {results['rto_cold_s']} s, "
              f"ratio {results['rto_warm_ratio_vs_cold']}; phases {results['rto_phases']}")  # fmt: skip
        results |= goodput_warm(args.goodput_steps, seed)
        print(f"goodput vs uninterrupted: warm {results['goodput_ratio_vs_uninterrupted']}, "
              f"cold {results['goodput_cold_ratio_vs_uninterrupted']}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = HERE / "results.json"
    merged = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps(merged | results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
