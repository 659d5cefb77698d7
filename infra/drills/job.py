"""The drill's job: its command line (the example job, or a user's job spec with the drill's own run
name filled in) and the loss curve of the same job run uninterrupted, against which a recovery is judged."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rewind.infra.drills import measure
from rewind.infra.errors import ConfigError, RewindError
from rewind.infra.launch.spec import JobSpec

# The repository, or the installed package: both hold examples/.
REPO = Path(__file__).resolve().parents[2]
JOB_DEFAULTS: dict[str, Any] = {"steps": 40, "every": 10, "seed": 0, "step_time_s": 0.15}
SPEC_UNSUPPORTED = ("rdzv_endpoint", "torchrun", "model")


def home() -> Path:
    return Path(os.environ.get("REWIND_HOME") or Path.home() / ".rewind").expanduser()


def job_of(configuration: dict[str, Any]) -> dict[str, Any]:
    return {**JOB_DEFAULTS, **(configuration.get("job") or {})}


def fill(value: str, run: str, out: Path, log: Path) -> str:
    """A user's job spec's placeholders (in its command and env values): ``{run}``, the drill's own run name
    (required: a drill never hurts the user's run), ``{out}``, a private output directory, and
    ``{loss_log}``, the loss log that gives the curve and the late phases."""
    return value.replace("{run}", run).replace("{out}", str(out)).replace("{loss_log}", str(log))


def check_job_spec(spec: JobSpec) -> dict[str, Any]:
    """A user's job spec as a drill runs it: it must take the drill's run name as ``{run}``."""
    d = spec.as_dict()
    if not any("{run}" in a for a in [*d["command"], *d["env"].values()]):
        raise ConfigError(
            "the job spec must take the run name as {run} in its command or env (a drill runs the job "
            "under a run of its own and never hurts yours); {out} and {loss_log} are filled in too"
        )
    odd = [k for k in SPEC_UNSUPPORTED if d.get(k) is not None]
    if odd:
        raise ConfigError(f"a drill cannot run a job spec that sets {', '.join(odd)} yet")
    return d


def command(configuration: dict[str, Any], run: str, out: Path, log: Path) -> list[str]:
    spec = configuration.get("job_spec")
    if spec:
        return [fill(a, run, out, log) for a in spec["command"]]
    j = job_of(configuration)
    return [
        "python", "-m", str(j.get("module") or "rewind.examples.tiny_lm"), "--run", run, "--steps",
        str(j["steps"]), "--checkpoint-every", str(j["every"]), "--seed", str(j["seed"]), "--out", str(out),
        "--step-time-s", str(j["step_time_s"]), "--loss-log", str(log), *j.get("extra", []),
    ]  # fmt: skip


def world_of(job: dict[str, Any]) -> int:
    """The ranks of the example job a scenario asks for (``nnodes`` x ``nproc_per_node``; one by default)."""
    return int(job.get("nnodes") or 1) * int(job.get("nproc_per_node") or 1)


def reference_curve(
    job: dict[str, Any], environ: dict[str, str] | None = None, spec: dict[str, Any] | None = None
) -> dict[int, float]:
    """The loss per step of the same job uninterrupted and unsupervised (own SQLite catalog), cached.

    With a user's job spec: its command as given (one process), when it writes a ``{loss_log}``;
    without one (or for a distributed job) there is no reference and no curve to compare."""
    if spec is not None and (
        spec["nnodes"] * spec["nproc_per_node"] > 1
        or not any("{loss_log}" in a for a in [*spec["command"], *spec["env"].values()])
    ):
        return {}
    h = hashlib.sha256(json.dumps(spec if spec is not None else job, sort_keys=True).encode())
    for src in ("examples/tiny_lm.py", "examples/tiny_lm_model.py"):  # a changed example: a new reference
        h.update((REPO / src).read_bytes())
    key = h.hexdigest()[:12]
    cached = home() / "drills" / f"reference-{key}.jsonl"
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="rewind-ref-") as tmp:
            log, out = Path(tmp) / "loss.jsonl", Path(tmp) / "out"
            if spec is not None:
                cmd = command({"job_spec": spec}, "reference", out, log)
                cwd, extra = (
                    spec["cwd"] or os.getcwd(),
                    {k: fill(v, "reference", out, log) for k, v in spec["env"].items()},
                )
            else:
                cmd = without_poison(command({"job": {**job, "step_time_s": 0.0}}, "reference", out, log))
                cmd += ["--nproc", str(world_of(job))] if world_of(job) > 1 else []  # torchrun, here
                cwd, extra = tmp, {}
            if cmd[0] in ("python", "python3"):
                cmd[0] = sys.executable
            own = {
                "REWIND_HOME": tmp,
                "REWIND_CATALOG_URL": "",
                "REWIND_CHECKPOINT_ROOT": "",
                "OMP_NUM_THREADS": "1",
            }
            env = {**(environ if environ is not None else os.environ), **extra, **own}
            for k in ("REWIND_FAULT", "REWIND_FAULT_ONCE"):
                env.pop(k, None)
            done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RewindError(f"the reference run failed: {done.stdout[-500:]}{done.stderr[-500:]}")
            os.replace(log, cached)
    return measure.reference_losses(measure.read_log(cached))


def without_poison(cmd: list[str]) -> list[str]:
    out, skip = [], False
    for c in cmd:
        if skip:
            skip = False
            continue
        if c == "--poison-position":
            skip = True
            continue
        out.append(c)
    return out
