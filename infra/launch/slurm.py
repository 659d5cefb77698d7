"""The Slurm launcher: an allocation per launch (``salloc --no-shell``), one ``srun`` step per node, each
running that node's torchrun agent (under the host's memory agent, ``host_agent``); node state from
``sinfo``; the allocation released with ``scancel``.

The supervisor runs where Slurm clients work (a login node, or inside an allocation's first
host) and keeps one ``srun`` per node as its child: a node's exit is its step's exit, a node's
output is its step's output. A host the scheduler marks not responding or down is lost, however
its step ended; the next launch leaves it out. The rendezvous is on the allocation's first host,
which is by construction one that is up.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time

from rewind.infra.errors import ConfigError, TransientError
from rewind.infra.launch import host_agent
from rewind.infra.launch.launchers import LauncherKind, Placement, Request

RDZV_PORT = 29400  # + launch id mod PORT_SPAN: a relaunch never waits for its predecessor's port
PORT_SPAN = 500
GRANT_TIMEOUT_S = 600.0  # how long a launch waits in the queue for its nodes
_GONE = ("down", "drain", "drng", "fail", "failg", "maint", "unk", "npc", "boot")  # sinfo %t states
_CALL_TIMEOUT_S = 30.0
MAX_SETTLE_S = 120.0


def _run(*cmd: str, timeout_s: float = _CALL_TIMEOUT_S) -> str:
    if shutil.which(cmd[0]) is None:
        raise ConfigError(f"the job spec asks for Slurm, but {cmd[0]} is not on PATH here")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TransientError(f"Slurm: {cmd[0]} did not answer in {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise TransientError(f"Slurm: {' '.join(cmd[:2])} failed: {last}")
    return done.stdout


def hostnames(nodelist: str) -> tuple[str, ...]:
    """``h[1-3],x`` as Slurm expands it."""
    return tuple(_run("scontrol", "show", "hostnames", nodelist).split())


def node_states(names: tuple[str, ...] | None = None) -> dict[str, str]:
    """Each node's compact state (``idle``, ``alloc``, ``down*``...); a ``*`` means not responding."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N %t"]
    if names:
        cmd += ["-n", ",".join(names)]
    return dict(line.split() for line in _run(*cmd).splitlines() if len(line.split()) == 2)


def set_node_state(name: str, state: str, *, reason: str | None = None) -> None:
    """``scontrol update`` of one node's state (an operator's right): ``down`` takes it from the scheduler,
    ending the job steps there, and ``resume`` gives it back."""
    cmd = ["scontrol", "update", f"nodename={name}", f"state={state}"]
    _run(*cmd, *([f"reason={reason}"] if reason else []))


def steps_on(allocation: str, host: str) -> list[str]:
    """The ids (``job.step``) of the allocation's job steps running on ``host`` and nowhere else."""
    out = _run("squeue", "-h", "-s", "-j", allocation, "-o", "%i %N")
    found = [line.split() for line in out.splitlines() if len(line.split()) == 2]
    return [sid for sid, nodes in found if hostnames(nodes) == (host,) and sid.split(".")[-1].isdigit()]


def signal_step(step: str, signal_name: str) -> None:
    """Signal every task of one job step (``job.step``)."""
    _run("scancel", f"--signal={signal_name}", step)


def controller_address() -> str:
    """The controller's address as the hosts reach it (``SlurmctldHost``'s address, else its name)."""
    found = re.search(r"^SlurmctldHost\[0\]\s*=\s*(\S+)", _run("scontrol", "show", "config"), re.M)
    if not found:
        raise ConfigError("scontrol show config names no SlurmctldHost")
    name, _, addr = found.group(1).partition("(")
    return addr.rstrip(")") or name


def gone(state: str) -> bool:
    return state.endswith("*") or state.rstrip("~#!%$@^-").startswith(_GONE)


class SlurmLauncher:
    kind = LauncherKind.SLURM

    def place(self, request: Request) -> Placement:
        cmd = ["salloc", "--no-shell", f"--nodes={request.nnodes}", "--ntasks-per-node=1",
               f"--job-name=rewind-{request.run}"]  # fmt: skip
        if request.exclude:
            cmd.append(f"--exclude={','.join(sorted(request.exclude))}")
        prefer = [h for h in request.prefer if h not in request.exclude][: request.nnodes]
        if prefer:
            cmd.append(f"--nodelist={','.join(prefer)}")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=GRANT_TIMEOUT_S, check=False)
        granted = re.search(r"Granted job allocation (\d+)", out.stderr + out.stdout)
        if out.returncode != 0 or not granted:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise TransientError(f"Slurm refused an allocation of {request.nnodes} node(s): {last}")
        job = granted.group(1)
        hosts = hostnames(_job_field(job, "NodeList"))
        ordered = tuple(h for h in prefer if h in hosts) + tuple(h for h in hosts if h not in prefer)
        port = RDZV_PORT + request.launch_id % PORT_SPAN
        return Placement(hosts=ordered, endpoint=f"{ordered[0]}:{port}", allocation=job)

    def node_command(self, placement: Placement, node: int, command: list[str]) -> list[str]:
        """The node's torchrun agent under its host's memory agent (which passes the peer ring in place of
        the ranks), whose store is node 0's, a port span above the rendezvous's; a launch of one node as is."""
        host, _, port = placement.endpoint.rpartition(":")
        store = f"{host}:{int(port) + PORT_SPAN}"
        task = host_agent.command(node, len(placement.hosts), store, placement.allocation or "", command)
        return [
            "srun", f"--jobid={placement.allocation}", "--nodes=1", "--ntasks=1",
            f"--nodelist={placement.hosts[node]}", "--kill-on-bad-exit=0", "--export=ALL", "--quiet",
            *task,
        ]  # fmt: skip

    def lost(self, placement: Placement) -> frozenset[str]:
        states = node_states(placement.hosts)
        return frozenset(h for h in placement.hosts if gone(states.get(h, "unk")))

    def usable(self, exclude: frozenset[str]) -> int:
        return sum(1 for h, s in node_states().items() if h not in exclude and not gone(s))

    def free(self) -> frozenset[str]:
        return frozenset(h for h, s in node_states().items() if s.rstrip("~#!%$@^-+") == "idle")

    def cancel(self, placement: Placement, *, signal_name: str | None = None) -> None:
        if placement.allocation is None:
            return
        if signal_name is None:
            _run("scancel", placement.allocation)
        else:
            _run("scancel", f"--signal={signal_name}", placement.allocation)

    def settle_s(self) -> float:
        """SlurmdTimeout plus a margin, at most ``MAX_SETTLE_S``: after that a host not called lost is up."""
        found = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", _run("scontrol", "show", "config"), re.M)
        return min(MAX_SETTLE_S, (int(found.group(1)) if found else 300) + 5.0)


def _job_field(job: str, name: str, timeout_s: float = 30.0) -> str:
    """One field of ``scontrol show job`` (the node list is there once the grant is)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _run("scontrol", "show", "job", job)
        found = re.search(rf"\b{name}=(\S+)", text)
        if found and found.group(1) != "(null)":
            return found.group(1)
        if time.monotonic() > deadline:
            raise TransientError(f"Slurm job {job} has no {name} after {timeout_s:.0f} s")
        time.sleep(0.2)
