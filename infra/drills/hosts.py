"""Drill actions that take a host away from a running job under Slurm: ``lose_host``, ``cut_host_network``,
and the rollback that gives every host back, ``bring_hosts_back``.

The faults are the scheduler's and the host's own, as in production, and need a Slurm cluster with a
spare host (``needs: slurm``) and an operator's rights:

- host loss: the scheduler takes the host out of service (``scontrol update state=drain``) and the job's
  step on it is killed (``scancel --signal=KILL`` of that step): its processes are gone and the scheduler
  reports the host unusable, as after a host's death; ``state=resume`` gives it back (a plain ``down``
  would not hold: a cluster with ``ReturnToService=2`` puts a host whose slurmd still answers straight
  back in service);
- network isolation: the host cuts its own network from inside (a step on it, ``srun --overlap``, as
  root): the interface that carries its route to the controller goes down for ``heal_after_s`` and comes
  back by itself (nothing outside could reach the host to bring it back); its ranks live on, cut off.

Every host a drill took is written to the drill's state directory first, so the rollback finds it whatever
happened in between.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from typing import Any

from rewind.infra.catalog import jobs
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills.context import run_of, state_dir
from rewind.infra.errors import ConfigError, NotFoundError, RewindError
from rewind.infra.launch import slurm

POLL_S = 0.2
TAKEN = "hosts-taken.json"


def _placed_past(run: str, at_step: int, timeout_s: float) -> Any:
    """The run's newest launch, once every rank of it passed ``at_step`` (bounded)."""
    cat, deadline = Catalog(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            launch = jobs.launches(cat, run)[-1]
        except (NotFoundError, IndexError):
            time.sleep(POLL_S)
            continue
        if launch.exit_code is not None:
            raise RewindError(f"{run} ended (exit code {launch.exit_code}) before step {at_step}")
        rows = jobs.progress(cat, launch.id)
        world = int((launch.handoff or {}).get("world_size") or 1)
        if len(rows) == world and all((r.step or 0) >= at_step for r in rows):
            return launch
        time.sleep(POLL_S)
    raise RewindError(f"{run} did not pass step {at_step} within {timeout_s:g}s")


def _allocation(launch: Any) -> str | None:
    return (launch.handoff or {}).get("allocation")


def _host_of(launch: Any, node: int) -> str:
    hosts = list((launch.handoff or {}).get("hosts") or [])
    if _allocation(launch) is None or node >= len(hosts):
        raise ConfigError(
            f"launch {launch.id} has no Slurm host for node {node}: run the drill with launcher slurm"
        )
    return str(hosts[node])


def _remember(
    configuration: dict[str, Any] | None, host: str, how: str, heal_at: float | None = None
) -> None:
    path = state_dir(configuration) / TAKEN
    taken = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*taken, {"host": host, "how": how, "heal_at": heal_at}]))


def lose_host(
    at_step: int, node: int = 1, timeout_s: float = 180.0, configuration: dict[str, Any] | None = None
) -> str:
    """Once the job passed ``at_step``: the scheduler takes node ``node``'s host away. Returns the host."""
    launch = _placed_past(run_of(configuration), at_step, timeout_s)
    host = _host_of(launch, node)
    _remember(configuration, host, "drain")
    slurm.set_node_state(host, "drain", reason="rewind drill: host-loss")
    for step in slurm.steps_on(str(_allocation(launch)), host):
        slurm.signal_step(step, "KILL")
    return host


def cut_host_network(
    at_step: int,
    node: int = 1,
    heal_after_s: float = 45.0,
    timeout_s: float = 180.0,
    configuration: dict[str, Any] | None = None,
) -> str:
    """Once the job passed ``at_step``: node ``node``'s host cuts its own network for ``heal_after_s``
    (from a step on it, as root). Returns the host."""
    launch = _placed_past(run_of(configuration), at_step, timeout_s)
    host = _host_of(launch, node)
    controller = slurm.controller_address()
    script = (
        f"dev=$(ip -o route get {shlex.quote(controller)} | sed -n 's/.* dev \\([^ ]*\\).*/\\1/p'); "
        f'[ -n "$dev" ] || exit 3; ip link set "$dev" down && sleep {float(heal_after_s)}; ip link set "$dev" up'
    )
    cmd = ["srun", f"--jobid={_allocation(launch)}", "--overlap", "--nodes=1", "--ntasks=1",
           f"--nodelist={host}", "--quiet", "sh", "-c", script]  # fmt: skip
    _remember(configuration, host, "network", heal_at=time.time() + heal_after_s)
    # srun loses its step once the link is down: it is left to end (or be ended) on its own
    subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return host


def bring_hosts_back(timeout_s: float = 120.0, configuration: dict[str, Any] | None = None) -> list[str]:
    """Rollback: every host the drill took in service again (a cut network healed, a downed host resumed)."""
    path = state_dir(configuration) / TAKEN
    taken = json.loads(path.read_text()) if path.exists() else []
    deadline = time.monotonic() + timeout_s
    for t in taken:
        if t.get("heal_at"):
            time.sleep(max(0.0, min(float(t["heal_at"]) - time.time(), deadline - time.monotonic())))
        _back_in_service(str(t["host"]), deadline)
    path.unlink(missing_ok=True)
    return [str(t["host"]) for t in taken]


def _back_in_service(host: str, deadline: float) -> None:
    """``state=resume`` until the scheduler has the host up (a healed host may need its timeout first)."""
    while True:
        state = slurm.node_states((host,)).get(host, "unk")
        if not slurm.gone(state) and not state.startswith(("drain", "drng")):
            return
        if state.rstrip("*").startswith(("down", "drain", "drng", "fail")):
            slurm.set_node_state(host, "resume")
        if time.monotonic() > deadline:
            raise RewindError(f"host {host} is {state} and did not come back in service")
        time.sleep(1.0)
