"""The serving drills' own stack and the faults they inject into it (no Prefect here).

A serving drill trains the example model into a catalog of its own (SQLite in the drill's directory),
verifies its checkpoints, and starts TorchServe instances behind HAProxy under the serving supervisor in
that directory; client traffic goes through the proxy the whole time (``traffic.Load``), every answer
recorded with the version and instance that gave it. The deploy and the rollout are flows
(``rewind.flows.drills_serving``); ``chaos.stop_servers`` stops what is started here and puts the
environment back.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rewind.infra.catalog.db import Catalog
from rewind.infra.drills.chaos import held_servers, set_env
from rewind.infra.drills.context import run_of, state_dir
from rewind.infra.drills.traffic import Load, Sample
from rewind.infra.errors import ConfigError, RewindError
from rewind.infra.launch.process import is_running

MODEL = "drill-lm"
POLL_S = 0.1
T = TypeVar("T")


@dataclass
class Rig:
    """One serving drill's stack directory and, while it runs, its client traffic."""

    directory: Path
    load: Load | None = None

    def traffic(self) -> Load:
        if self.load is None:
            raise ConfigError("the drill sends no traffic yet (start_traffic comes first)")
        return self.load

    def stop(self) -> None:
        from rewind.infra.serving import stack

        if self.load is not None:
            self.load.stop()
        if (self.directory / stack.STACK_FILE).exists():  # else never started: nothing to stop
            stack.stop(self.directory)


def rig_of(configuration: dict[str, Any] | None) -> Rig:
    rig: Rig | None = held_servers(configuration).get("serving")
    if rig is None:
        raise ConfigError("the drill started no serving stack (start_serving comes first)")
    return rig


def until(probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """``probe()``'s first truthy value, polled; a bounded wait that names what never happened."""
    deadline = time.monotonic() + timeout_s
    while not (got := probe()):
        if time.monotonic() > deadline:
            raise RewindError(f"{what}: not within {timeout_s:g} s")
        time.sleep(POLL_S)
    return got


# -- actions ---------------------------------------------------------------------------------------


def start_serving(
    instances: int = 2, steps: int = 90, every: int = 30, timeout_s: float = 300.0,
    configuration: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Train the example model (``steps``, a checkpoint every ``every``) into the drill's own catalog,
    verify every checkpoint, and start ``instances`` TorchServe servers behind HAProxy there."""
    from rewind.infra.serving import stack

    run, state, held = run_of(configuration), state_dir(configuration), held_servers(configuration)
    rig = held["serving"] = Rig(state / "serving")
    set_env(held, {
        "REWIND_CATALOG_URL": f"sqlite:///{state / 'serving-catalog.db'}",
        "REWIND_CHECKPOINT_ROOT": str(state / "checkpoints"),
        "REWIND_SERVING_HOME": str(rig.directory),
    })  # fmt: skip
    t0 = time.monotonic()
    _train(run, state, steps, every, timeout_s)
    steps_verified = _verified(Catalog(), run)
    trained = time.monotonic()
    stack.start(rig.directory, instances=instances, timeout_s=timeout_s)
    return {"run": run, "verified_steps": steps_verified, "instances": instances,
            "train_s": round(trained - t0, 2), "stack_s": round(time.monotonic() - trained, 2)}  # fmt: skip


def _verified(cat: Catalog, run: str) -> list[int]:
    """Verify the drill's own run; its verified steps, or an error naming those that did not verify."""
    from rewind.infra.phases.notify import LogNotifier
    from rewind.infra.phases.verify import verify_run

    checked = verify_run(cat, run=run, notify=LogNotifier())
    bad = [r.step for r in checked if r.status.value != "verified"]
    if bad:
        raise RewindError(f"the drill's own checkpoints of {run} at steps {bad} did not verify")
    return [r.step for r in checked]


def _train(run: str, state: Path, steps: int, every: int, timeout_s: float) -> None:
    log = state / "train.log"
    cmd = [sys.executable, "-m", "rewind.examples.tiny_lm", "--run", run, "--steps", str(steps),
           "--checkpoint-every", str(every), "--out", str(state / "out"), "--lr", "0.01", "--batch-size", "32"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
    if rc != 0:
        raise RewindError(f"the drill's example training exited {rc}; see {log}")


def start_traffic(workers: int = 4, max_s: float = 600.0, configuration: dict[str, Any] | None = None) -> str:
    """Clients posting through the model's proxy until the drill stops them (at most ``max_s``)."""
    from rewind.infra.serving import stack

    rig = rig_of(configuration)
    st = stack.load(rig.directory)
    key = json.loads(st.endpoints.key_file.read_text())["inference"]["key"]
    url = st.proxy(MODEL).url + f"/predictions/{MODEL}"
    rig.load = Load(url, key, workers=workers, max_s=max_s).start()
    until(lambda: rig.traffic().count() > 0, 60, "a first answer through the proxy")
    return url


def kill_instance(
    after_answers: int = 20, timeout_s: float = 120.0, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Once every instance has answered (and ``after_answers`` in all), SIGKILL one instance's whole process
    group, chosen by the drill's seed; measure until it answers again and ``after_answers`` more came."""
    from rewind.infra.serving import stack

    rig = rig_of(configuration)
    load, st = rig.traffic(), stack.load(rig.directory)
    if len(st.pids) < 2:
        raise ConfigError("torchserve-kill needs at least 2 instances: the others answer meanwhile")
    seed = int((configuration or {}).get("seed") or 0)
    victim = random.Random(seed).randrange(len(st.pids))
    everyone = {str(i) for i in range(len(st.pids))}
    until(lambda: load.count() >= after_answers and {s.instance for s in load.taken()} >= everyone,
          timeout_s, "every instance answering")  # fmt: skip
    # as the stack is now: the supervisor may have restarted that instance meanwhile
    pid = stack.load(rig.directory).pids[victim]
    if not is_running(pid, "torchserve"):
        raise ConfigError(f"instance {victim} (pid {pid}) is not running: nothing to kill")
    killed_at = time.time()
    os.killpg(pid, signal.SIGKILL)

    def answered_again() -> Sample | None:
        return next((s for s in load.taken() if s.instance == str(victim) and s.started > killed_at
                     and s.status == 200), None)  # fmt: skip

    back = until(answered_again, timeout_s, f"instance {victim} answering again after SIGKILL")
    settle = load.count()
    until(lambda: load.count() >= settle + after_answers, timeout_s, "answers after the restart")
    return {
        "victim": victim,
        "seed": seed,
        "killed_at": killed_at,
        "back_s": round(back.ended - killed_at, 3),
    }


def stop_traffic(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Stop the clients; what they saw: requests, failures (a few named), and per version its answers and
    the first and last second it answered."""
    load = rig_of(configuration).traffic()
    load.stop()
    samples = load.taken()
    failed = [s for s in samples if s.status != 200]
    versions: dict[str, dict[str, Any]] = {}
    for s in samples:
        if s.status == 200 and s.version is not None:
            v = versions.setdefault(s.version, {"answers": 0, "first": s.started, "last": s.ended})
            v["answers"] += 1
            v["first"], v["last"] = min(v["first"], s.started), max(v["last"], s.ended)
    return {"requests": len(samples), "failed": len(failed), "versions": versions,
            "failures": [{"at": s.started, "status": s.status, "instance": s.instance} for s in failed[:5]]}  # fmt: skip


def make_bad_version(
    step: int = 90, seed: int = 1, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A bad model version: the drill's checkpoint at ``step`` with its embedding rows shuffled, saved and
    verified as its own run (intact bytes: only the model is wrong). Returns that run and both versions'
    quality on the example's probe set."""
    from rewind.examples.tiny_lm_model import accuracy, from_weights, scramble
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.serving.export import verified_weights

    run, cat = run_of(configuration), Catalog()
    _, weights = verified_weights(cat, run, step)
    good = accuracy(from_weights(weights))
    model = scramble(from_weights(weights), seed)
    bad_run = f"{run}-bad"
    ck = Checkpointer(bad_run, states={"model": model}, catalog=cat)
    try:
        ck.save(step)
    finally:
        ck.close()
    _verified(cat, bad_run)
    made = {
        "run": bad_run,
        "step": step,
        "good_quality": round(good, 3),
        "bad_quality": round(accuracy(model), 3),
    }
    held_servers(configuration)["bad_version"] = made  # what the rollout action rolls out
    return made
