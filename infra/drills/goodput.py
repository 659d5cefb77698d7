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
from rewind.infra.launch import warm

Command = Callable[[str, Path, Path], list[str]]  # (run, out dir, loss log) -> argv


def _until_step(proc: Any, log: Path, step: int, timeout_s: float, since: int = 0) -> bool:
    """Wait (bounded) until the log shows ``step`` after its first ``since`` records (True) or the process
    ends (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r.get("step", -1) >= step for r in read_log(log)[since:]):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} within {timeout_s:g}s")


class _Launcher:
    """How each launch of a policy starts: a new interpreter, or (``warm``) handed to a standby made while
    the previous launch ran, a new interpreter when none is ready."""

    def __init__(self, warm_key: str | None, cwd: str) -> None:
        self.warm_key, self.cwd = warm_key, cwd
        self.warm_launches, self.started = 0, False

    def __call__(self, cmd: list[str], env: dict[str, str]) -> Any:
        if self.warm_key is not None:
            with open(os.devnull, "wb") as null:
                handed = warm.handoff(self.warm_key, 0, cmd, self.cwd, env, null.fileno())
            if handed is not None or not self.started:  # the next launch's, made while this one runs
                warm.start(self.warm_key, 0, cmd, self.cwd, env)
                self.started = True
            if handed is not None:
                self.warm_launches += 1
                return handed
        return subprocess.Popen(
            cmd, env=env, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def close(self) -> None:
        if self.warm_key is not None:
            warm.stop(self.warm_key, 0)


def _policy(
    command: Command,
    steps: int,
    kills: list[int],
    fresh: bool,
    env: dict[str, str],
    warm_relaunch: bool = False,
) -> tuple[float, list[dict[str, Any]]]:
    """Wall seconds to finish ``steps`` when killed at each of ``kills``, and each launch's start-up
    (process start to its first step), steps run and whether a standby took it over."""
    with tempfile.TemporaryDirectory(prefix="rewind-goodput-") as tmp:
        penv = {**env, "REWIND_HOME": tmp, "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": ""}
        start = _Launcher(f"goodput-{Path(tmp).name}" if warm_relaunch else None, tmp)
        t0, launches = time.monotonic(), []
        try:
            log = Path(tmp) / "loss.jsonl"  # one for every launch: the relaunched command is the same
            for i, at in enumerate([*kills, None]):
                began, warm_before, since = time.time(), start.warm_launches, len(read_log(log))
                run = f"goodput-{i}" if fresh else "goodput"
                proc = start(command(run, Path(tmp) / "out", log), penv)
                try:
                    if at is not None and _until_step(proc, log, at, 300, since):
                        os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=600)
                finally:
                    if proc.poll() is None:
                        os.kill(proc.pid, signal.SIGKILL)
                        proc.wait(timeout=30)
                done = [r for r in read_log(log)[since:] if "step" in r]
                launches.append({
                    "startup_s": round(done[0]["t"] - began, 2) if done else None,
                    "steps": [done[0]["step"], done[-1]["step"]] if done else None,
                    "warm": start.warm_launches > warm_before,
                })  # fmt: skip
        finally:
            start.close()
        return time.monotonic() - t0, launches


def goodput(
    command: Command,
    *,
    steps: int,
    failures: int,
    seed: int | None = None,
    warm_relaunch: bool = False,
    from_scratch: bool = True,
) -> dict[str, Any]:
    """The same job run with no failure, resumed by Rewind after each seeded kill, and (``from_scratch``)
    restarted from scratch after each; with ``warm_relaunch``, also resumed by Rewind from a standby
    (``rewind_warm``)."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    kills = sorted(rng.randint(3, steps - 3) for _ in range(failures))
    env = {k: v for k, v in os.environ.items() if k not in ("REWIND_FAULT", "REWIND_FAULT_ONCE")}
    policies = {"no_failure": ([], False, False), "rewind": (kills, False, False)}
    if from_scratch:
        policies["from_scratch"] = (kills, True, False)
    if warm_relaunch:
        policies["rewind_warm"] = (kills, False, True)
    walls, launches = {}, {}
    for name, (at, fresh, warm_) in policies.items():
        walls[name], launches[name] = _policy(command, steps, at, fresh, env, warm_)
    out: dict[str, Any] = {
        "launches": launches, "seed": seed, "steps": steps, "killed_at_steps": kills,
        "wall_s": {k: round(v, 2) for k, v in walls.items()},
        "goodput_steps_per_s": {k: round(steps / v, 3) for k, v in walls.items()},
        "rewind_vs_no_failure": round(walls["no_failure"] / walls["rewind"], 3),
    }  # fmt: skip
    if from_scratch:
        out["rewind_vs_from_scratch"] = round(walls["from_scratch"] / walls["rewind"], 3)
    if warm_relaunch:
        out["rewind_warm_vs_no_failure"] = round(walls["no_failure"] / walls["rewind_warm"], 3)
    return out
