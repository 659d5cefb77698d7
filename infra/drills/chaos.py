"""Rewind's Chaos Toolkit extension: actions that hurt a running job or its checkpoints, and probes.

Experiments name these as ``{"type": "python", "module": "rewind.infra.drills.chaos", "func": ...}``;
their probes live in ``rewind.infra.drills.probes``.
Every function takes the experiment's ``configuration`` (``run``: the drill's run; ``state_dir``: a
private directory of the drill) and reads the catalog from the environment. No Prefect here: what
starts and recovers the job (the flows) is named by the experiment separately. A drill may start
servers of its own (``rewind.infra.drills.servers``: S3, PostgreSQL, a Prefect server as a process) and
stop them mid-run; ``stop_servers`` stops them and puts the environment back.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal as signals
import time
from pathlib import Path
from typing import Any

from rewind.infra import faults
from rewind.infra.catalog import copies, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus
from rewind.infra.drills import servers
from rewind.infra.drills.context import run_of, state_dir
from rewind.infra.errors import ConfigError, NotFoundError, RewindError
from rewind.infra.format import chunked, packs, store

log = logging.getLogger("rewind.drill")
POLL_S = 0.2
# run -> the servers its drill started (s3, postgres, prefect), and the environment values they replaced
_SERVERS: dict[str, dict[str, Any]] = {}


# -- actions -----------------------------------------------------------------------------------


def arm_fault(spec: str, configuration: dict[str, Any] | None = None) -> str:
    """Arm the fault seam (``REWIND_FAULT``) for the processes started from now on, to fire once.

    ``spec`` is ``<kill|enospc|eio|eacces>:<point>[@step]``: disk full is ``enospc:save.file_written``,
    a checkpoint write interrupted is ``kill:save.before_rename``."""
    action, _, point = spec.partition(":")
    if action not in ("kill", "enospc", "eio", "eacces") or not point:
        raise ConfigError(f"fault {spec!r} is not <kill|enospc|eio|eacces>:<point>[@step]")
    fired = state_dir(configuration) / "fault-fired"
    fired.unlink(missing_ok=True)
    os.environ[faults.ENV] = spec
    os.environ[faults.ONCE_ENV] = str(fired)
    return spec


def disarm_fault(configuration: dict[str, Any] | None = None) -> None:
    os.environ.pop(faults.ENV, None)
    os.environ.pop(faults.ONCE_ENV, None)


def _not_ended(run: str, launches: list[Any], at_step: int) -> None:
    """A job that ended before the step a drill waits for makes the drill fail now, not at its timeout."""
    if launches and launches[-1].exit_code is not None:
        raise RewindError(
            f"{run} ended (exit code {launches[-1].exit_code}) before step {at_step}: "
            "the job is too short for this scenario"
        )


def signal_rank(
    at_step: int,
    rank: int = 0,
    signal: str = "SIGKILL",
    timeout_s: float = 180.0,
    configuration: dict[str, Any] | None = None,
) -> int:
    """Wait (bounded) until ``rank`` of the run's newest launch reported ``at_step``, then signal it:
    SIGKILL loses the rank, SIGSTOP hangs it. Returns the pid signalled."""
    run, sig = run_of(configuration), getattr(signals, signal, None)
    if not isinstance(sig, signals.Signals):
        raise ConfigError(f"{signal!r} is not a signal name")
    cat, deadline = Catalog(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ls = jobs.launches(cat, run)
        except NotFoundError:
            ls = []
        _not_ended(run, ls, at_step)
        for p in jobs.progress(cat, ls[-1].id) if ls else []:
            if p.rank == rank and (p.step or 0) >= at_step:
                os.kill(p.pid, sig)
                return p.pid
        time.sleep(POLL_S)
    raise RewindError(f"rank {rank} of {run} did not reach step {at_step} within {timeout_s:g}s")


def damage_newest_checkpoint(
    how: str, every: bool = False, configuration: dict[str, Any] | None = None
) -> list[str]:
    """Damage the newest restorable checkpoint's copies on this node, its local copy and its copy in the node's
    memory tier if it has one (``every``: every checkpoint's): ``flip_byte`` in its largest data file,
    ``delete_shard`` (a data file), or ``delete_manifest``. Returns what was damaged."""
    run = run_of(configuration)
    cat = Catalog()
    try:
        found = lineage.restorable(cat, lineage.get_run(cat, run).id)
    except NotFoundError:
        found = []
    if not found:
        raise NotFoundError(f"{run} has no checkpoint to damage")
    chosen = found if every else found[:1]
    in_memory = copies.copies_of(cat, [ck.id for ck in chosen])
    return [
        _damage(Path(where), ck.step, how)
        for ck in chosen
        for where in (ck.path, *_held_in_memory(in_memory.get(ck.id, [])))
    ]


def _held_in_memory(replicas: list[Any]) -> list[str]:
    """The memory copies the catalog holds sound (one let go is gone from memory and says so)."""
    sound = (ReplicaStatus.VERIFIED.value, ReplicaStatus.PENDING.value)
    return [r.uri for r in replicas if r.tier == copies.MEMORY and r.status in sound and Path(r.uri).is_dir()]


def _damage(d: Path, step: int, how: str) -> str:
    # The chunked format: prefer a pack (or first-format chunk) no other checkpoint links.
    stores = [d / sub for sub in (packs.PACK_DIR, chunked.LEGACY_CHUNK_DIR) if (d / sub).is_dir()]
    found = [*d.iterdir(), *(f for sub in stores for f in sub.iterdir())]
    data = sorted(
        (f for f in found if f.suffix in (".safetensors", ".distcp") or f.parent in stores),
        key=lambda f: (f.stat().st_nlink > 1, -f.stat().st_size),
    )
    if how == "delete_manifest":
        target = d / "manifest.json"
        target.unlink()
    elif how == "delete_shard" and data:
        target = data[0]
        target.unlink()
    elif how == "flip_byte" and data:
        target = data[0]
        _flip(target)
    else:
        raise ConfigError(f"cannot {how!r} step {step} of {d}")
    return f"{how} step {step}: {target}"


def delete_local_tier(configuration: dict[str, Any] | None = None) -> str:
    """Node loss: every copy of the run on this node is gone, on its local tier and in its memory tier (the
    catalog is not told: the restore finds out, as after a real loss)."""
    from rewind.infra.memory import place

    run = run_of(configuration)
    root = Path(
        os.environ.get("REWIND_CHECKPOINT_ROOT")
        or Path(os.environ.get("REWIND_HOME", "~/.rewind")).expanduser() / "checkpoints"
    )
    memory = place.root()
    gone = [root / run, *([memory / run] if memory is not None else [])]
    for target in gone:
        shutil.rmtree(target, ignore_errors=True)
    return ", ".join(map(str, gone))


def held_servers(configuration: dict[str, Any] | None) -> dict[str, Any]:
    """What the drill of this configuration started (``s3``, ``postgres``, ``prefect``, ``serving``) and the
    environment values it replaced (``env``)."""
    return _SERVERS.setdefault(run_of(configuration), {"env": {}})


def set_env(held: dict[str, Any], values: dict[str, str]) -> None:
    """Set ``values`` in this process's environment; ``stop_servers`` puts the old ones back."""
    for k, v in values.items():
        held["env"].setdefault(k, os.environ.get(k))  # the first value seen is the one put back
        os.environ[k] = v


def start_catalog(configuration: dict[str, Any] | None = None) -> str:
    """Start the drill's own PostgreSQL cluster (initdb in the drill's directory, a free loopback port),
    create the catalog there and point this process's REWIND_CATALOG_URL at it: the job, its supervisor
    and the flows use it; the drill itself is still recorded in the catalog it was started with."""
    held = held_servers(configuration)
    pg = servers.PostgresCluster(state_dir(configuration) / "pg")
    pg.start()
    held["postgres"] = pg
    Catalog(pg.url)  # migrated to the newest schema
    set_env(held, {"REWIND_CATALOG_URL": pg.url})
    return f"postgresql://127.0.0.1:{pg.port}/{pg.database}"


def restart_catalog(
    at_step: int,
    mode: str = "fast",
    outage_s: float = 0.0,
    timeout_s: float = 180.0,
    configuration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Once a rank of the run reported ``at_step`` (bounded wait), stop the drill's PostgreSQL
    (``fast``: every session is ended, as a service restart does; ``immediate``: a crash), keep it down
    for ``outage_s`` (the fault's length) and start it again. Returns the step reached and the seconds
    the catalog was down."""
    held = held_servers(configuration)
    pg: servers.PostgresCluster | None = held.get("postgres")
    if pg is None:
        raise ConfigError("the drill started no PostgreSQL (start_catalog comes first)")
    reached = _await_step(run_of(configuration), at_step, timeout_s)
    down = time.monotonic()
    pg.stop(mode)
    time.sleep(outage_s)  # the outage itself, not a wait for anything
    pg.start()
    return {"at_step": reached, "down_s": round(time.monotonic() - down, 3), "mode": mode}


def start_prefect(configuration: dict[str, Any] | None = None) -> str:
    """Start the drill's own Prefect server (its own database, in the drill's directory); the drill's
    flows (protect-training, recover-training) talk to it. Returns its API URL."""
    held = held_servers(configuration)
    server = servers.PrefectServer(state_dir(configuration) / "prefect")
    server.start()
    held["prefect"] = server
    return server.api


def own_prefect_api(configuration: dict[str, Any] | None = None) -> str | None:
    """The API URL of the Prefect server the drill started for itself (while it runs), or None."""
    server = _SERVERS.get(run_of(configuration), {}).get("prefect")
    return str(server.api) if server is not None else None


def _await_step(run: str, at_step: int, timeout_s: float) -> int:
    """The step a rank of the run's newest launch reported once it is at least ``at_step`` (bounded)."""
    cat, deadline = Catalog(), time.monotonic() + timeout_s
    while True:
        try:
            ls = jobs.launches(cat, run)
        except NotFoundError:
            ls = []
        steps = [p.step or 0 for p in jobs.progress(cat, ls[-1].id)] if ls else []
        if steps and max(steps) >= at_step:
            return max(steps)
        _not_ended(run, ls, at_step)
        if time.monotonic() > deadline:
            raise RewindError(f"{run} did not reach step {at_step} within {timeout_s:g}s")
        time.sleep(POLL_S)


def restart_prefect(
    at_step: int, outage_s: float = 0.0, timeout_s: float = 180.0, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Once a rank of the run reported ``at_step``, stop the drill's Prefect server (SIGTERM, then SIGKILL),
    keep it down ``outage_s`` and start it again on the same port and database."""
    server: servers.PrefectServer | None = held_servers(configuration).get("prefect")
    if server is None:
        raise ConfigError("the drill started no Prefect server (start_prefect comes first)")
    reached = _await_step(run_of(configuration), at_step, timeout_s)
    down = time.monotonic()
    server.stop()
    time.sleep(outage_s)  # the outage itself, not a wait for anything
    server.start()
    return {"at_step": reached, "down_s": round(time.monotonic() - down, 3)}


def own_catalog(configuration: dict[str, Any] | None = None) -> str | None:
    """The URL of the catalog the drill started for itself (while it runs), or None."""
    pg = _SERVERS.get(run_of(configuration), {}).get("postgres")
    return str(pg.url) if pg is not None else None


def stop_servers(now: bool = False, configuration: dict[str, Any] | None = None) -> list[str]:
    """Rollback: stop every server the drill started and put the environment back as it was. Where the
    configuration says ``servers_stopped_by: rewind``, the drill runner does it itself after measuring
    (what the job recorded in the drill's own catalog goes with it), unless ``now``."""
    if not now and (configuration or {}).get("servers_stopped_by") == "rewind":
        return []
    held = _SERVERS.pop(run_of(configuration), {"env": {}})
    stopped = []
    try:
        # the serving stack first: its traffic and proxies before the servers under them
        for name, stop in (("serving", "stop"), ("s3", "stop"), ("postgres", "discard"), ("prefect", "stop")):
            if held.get(name) is None:
                continue
            try:
                getattr(held[name], stop)()
                stopped.append(name)
            except Exception as exc:  # one server that will not stop must not leave the others running
                log.warning("drill: stopping %s failed: %s", name, exc)
    finally:  # the next drill in this process must not inherit this one's endpoints
        for k, v in held["env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return stopped


def _flip(target: Path) -> None:
    """One byte of ``target`` flipped, as a damaged copy renamed over it: a checkpoint's file is never
    written in place (design.md §4.1), so a restore that mapped it keeps the bytes it proved."""
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    store.replace_file(target, store.bytes_writer(bytes(data)))
