"""Goodput under failures: useful steps per wall-clock second of a job hit by N SIGKILLs at random steps,
resumed by Rewind, against (a) the same job with no failure and (b) the naive policy of restarting it
from scratch after each failure. The job is any command that writes a loss log (``--loss-log``, one JSON
line per step, as the examples do); each policy runs in its own private catalog and checkpoint root."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rewind.infra.drills.measure import read_log

Command = Callable[[str, Path, Path], list[str]]  # (run, out dir, loss log) -> argv


def _until_step(proc: subprocess.Popen, log: Path, step: int, timeout_s: float) -> bool:
    """Wait (bounded) until the log shows ``step`` (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.get("step", -1) >= step for r in read_log(log)):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} within {timeout_s:g}s")


def _policy(
    command: Command, steps: int, kills: list[int], fresh: bool, env: dict[str, str]
) -> tuple[float, list[dict[str, Any]]]:
    """Wall seconds to finish ``steps`` when killed at each of ``kills``, and each launch's start-up
    (process start to its first step) and steps run."""
    with tempfile.TemporaryDirectory(prefix="rewind-goodput-") as tmp:
        penv = {**env, "REWIND_HOME": tmp, "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": ""}
        t0, launches = time.monotonic(), []
        for i, at in enumerate([*kills, None]):
            began = time.time()
            run = f"goodput-{i}" if fresh else "goodput"
            log = Path(tmp) / f"loss-{i}.jsonl"
            proc = subprocess.Popen(
                command(run, Path(tmp) / "out", log),
                env=penv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                if at is not None and _until_step(proc, log, at, 300):
                    proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=600)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
            done = [r for r in read_log(log) if "step" in r]
            launches.append({
                "startup_s": round(done[0]["t"] - began, 2) if done else None,
                "steps": [done[0]["step"], done[-1]["step"]] if done else None,
            })  # fmt: skip
        return time.monotonic() - t0, launches


def goodput(command: Command, *, steps: int, failures: int, seed: int | None = None) -> dict[str, Any]:
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    kills = sorted(rng.randint(3, steps - 3) for _ in range(failures))
    env = {k: v for k, v in os.environ.items() if k not in ("REWIND_FAULT", "REWIND_FAULT_ONCE")}
    none, none_l = _policy(command, steps, [], False, env)
    rewind, rewind_l = _policy(command, steps, kills, False, env)
    naive, naive_l = _policy(command, steps, kills, True, env)
    return {
        "launches": {"no_failure": none_l, "rewind": rewind_l, "from_scratch": naive_l},
        "seed": seed, "steps": steps, "killed_at_steps": kills,
        "wall_s": {"no_failure": round(none, 2), "rewind": round(rewind, 2), "from_scratch": round(naive, 2)},
        "goodput_steps_per_s": {k: round(steps / v, 3) for k, v in
                                {"no_failure": none, "rewind": rewind, "from_scratch": naive}.items()},
        "rewind_vs_no_failure": round(none / rewind, 3),
        "rewind_vs_from_scratch": round(naive / rewind, 3),
    }  # fmt: skip
