"""Rewind's Chaos Toolkit extension: actions that hurt a running job or its checkpoints, and probes.

Experiments name these as ``{"type": "python", "module": "infra.drills.chaos", "func": ...}``.
Every function takes the experiment's ``configuration`` (``run``: the drill's run; ``state_dir``: a
private directory of the drill) and reads the catalog from the environment. No Prefect here: what
starts and recovers the job (the flows) is named by the experiment separately.
"""

from __future__ import annotations

import os
import shutil
import signal as signals
import time
from pathlib import Path
from typing import Any

from infra import faults
from infra.catalog import incidents, jobs, lineage
from infra.catalog.db import Catalog
from infra.drills import slo
from infra.errors import ConfigError, NotFoundError
from infra.format.verify import check_copy

POLL_S = 0.2


def _run(configuration: dict[str, Any] | None) -> str:
    if not configuration or not configuration.get("run"):
        raise ConfigError("the experiment's configuration names no run")
    return str(configuration["run"])


def _state(configuration: dict[str, Any] | None) -> Path:
    d = Path(str((configuration or {}).get("state_dir") or "."))
    d.mkdir(parents=True, exist_ok=True)
    return d


# -- actions -----------------------------------------------------------------------------------


def arm_fault(spec: str, configuration: dict[str, Any] | None = None) -> str:
    """Arm the fault seam (``REWIND_FAULT``) for the processes started from now on, to fire once.

    ``spec`` is ``<kill|enospc|eio|eacces>:<point>[@step]``: disk full is ``enospc:save.file_written``,
    a checkpoint write interrupted is ``kill:save.before_rename``."""
    action, _, point = spec.partition(":")
    if action not in ("kill", "enospc", "eio", "eacces") or not point:
        raise ConfigError(f"fault {spec!r} is not <kill|enospc|eio|eacces>:<point>[@step]")
    fired = _state(configuration) / "fault-fired"
    fired.unlink(missing_ok=True)
    os.environ[faults.ENV] = spec
    os.environ[faults.ONCE_ENV] = str(fired)
    return spec


def disarm_fault(configuration: dict[str, Any] | None = None) -> None:
    os.environ.pop(faults.ENV, None)
    os.environ.pop(faults.ONCE_ENV, None)


def signal_rank(
    at_step: int,
    rank: int = 0,
    signal: str = "SIGKILL",
    timeout_s: float = 180.0,
    configuration: dict[str, Any] | None = None,
) -> int:
    """Wait (bounded) until ``rank`` of the run's newest launch reported ``at_step``, then signal it:
    SIGKILL loses the rank, SIGSTOP hangs it. Returns the pid signalled."""
    run, sig = _run(configuration), getattr(signals, signal, None)
    if not isinstance(sig, signals.Signals):
        raise ConfigError(f"{signal!r} is not a signal name")
    cat, deadline = Catalog(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ls = jobs.launches(cat, run)
        except NotFoundError:
            ls = []
        for p in jobs.progress(cat, ls[-1].id) if ls and ls[-1].exit_code is None else []:
            if p.rank == rank and (p.step or 0) >= at_step:
                os.kill(p.pid, sig)
                return p.pid
        time.sleep(POLL_S)
    raise TimeoutError(f"rank {rank} of {run} did not reach step {at_step} within {timeout_s:g}s")


def damage_newest_checkpoint(
    how: str, every: bool = False, configuration: dict[str, Any] | None = None
) -> list[str]:
    """Damage the newest restorable checkpoint's local copy (``every``: all of them): ``flip_byte`` in its
    largest data file, ``delete_shard`` (a data file), or ``delete_manifest``. Returns what was damaged."""
    run = _run(configuration)
    cat = Catalog()
    try:
        found = lineage.restorable(cat, lineage.get_run(cat, run).id)
    except NotFoundError:
        found = []
    if not found:
        raise NotFoundError(f"{run} has no checkpoint to damage")
    return [_damage(ck, how) for ck in (found if every else found[:1])]


def _damage(ck: Any, how: str) -> str:
    d = Path(ck.path)
    data = sorted(
        (f for f in d.iterdir() if f.suffix in (".safetensors", ".distcp")), key=lambda f: -f.stat().st_size
    )
    if how == "delete_manifest":
        target = d / "manifest.json"
        target.unlink()
    elif how == "delete_shard" and data:
        target = data[0]
        target.unlink()
    elif how == "flip_byte" and data:
        target = data[0]
        with open(target, "r+b") as f:
            f.seek(target.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
    else:
        raise ConfigError(f"cannot {how!r} step {ck.step} of {ck.path}")
    return f"{how} step {ck.step}: {target}"


def delete_local_tier(configuration: dict[str, Any] | None = None) -> str:
    """Node loss: every local copy of the run is gone (its directory under the local checkpoint tier)."""
    run = _run(configuration)
    root = Path(
        os.environ.get("REWIND_CHECKPOINT_ROOT")
        or Path(os.environ.get("REWIND_HOME", "~/.rewind")).expanduser() / "checkpoints"
    )
    target = root / run
    shutil.rmtree(target, ignore_errors=True)
    return str(target)


# -- probes ------------------------------------------------------------------------------------


def _newest(run: str) -> Any:
    cat = Catalog()
    try:
        ck = lineage.restorable(cat, lineage.get_run(cat, run).id)
    except NotFoundError:
        return None
    return ck[0] if ck else None


def newest_checkpoint_verifies(configuration: dict[str, Any] | None = None) -> bool:
    """The newest restorable checkpoint's local copy proves itself, every byte (true when there is none yet)."""
    ck = _newest(_run(configuration))
    return ck is None or check_copy(Path(ck.path), ck.manifest_digest, deep=True).ok


def fault_fired(configuration: dict[str, Any] | None = None) -> bool:
    return (_state(configuration) / "fault-fired").exists()


def run_progressing(within_s: float = 30.0, configuration: dict[str, Any] | None = None) -> bool:
    """The run's newest launch finished cleanly, or one of its ranks advanced within ``within_s``
    (true before the run exists: nothing to be stuck)."""
    run, cat = _run(configuration), Catalog()
    try:
        ls = jobs.launches(cat, run)
    except NotFoundError:
        return True
    if not ls:
        return True
    if ls[-1].exit_code is not None:
        return ls[-1].exit_code == 0
    deadline = time.monotonic() + within_s

    def steps() -> int:
        return max((p.step or 0 for p in jobs.progress(cat, ls[-1].id)), default=0)

    first = steps()
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        if steps() > first or jobs.get_launch(cat, ls[-1].id).exit_code == 0:
            return True
    return False


def incident_resolved_within_slo(
    kind: str, slo_file: str | None = None, configuration: dict[str, Any] | None = None
) -> bool:
    """The run's newest incident is resolved, within the SLO's RTO for ``kind`` (true with no incident)."""
    run = _run(configuration)
    try:
        found = incidents.incidents_of(Catalog(), run)
    except NotFoundError:
        return True
    if not found:
        return True
    inc = found[-1]
    budget = slo.load(slo_file or (configuration or {}).get("slo_file")).for_kind(kind)
    return inc.resolved_at is not None and inc.rto_s is not None and inc.rto_s <= budget.rto_s
