"""Where a launch's nodes run: one small interface, a launcher per kind of place (``local``, ``slurm``).

The supervisor asks a launcher to ``place`` a launch (N nodes, never on an excluded host,
preferring the hosts named), wraps each node's torchrun agent in the launcher's
``node_command``, and asks it which placed hosts the scheduler has lost. The job spec
names its launcher (``launcher: slurm``); nothing else about the job changes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from rewind.infra.net import free_port


class LauncherKind(StrEnum):
    LOCAL = "local"  # child processes of the supervisor, on this machine
    SLURM = "slurm"  # one torchrun agent per allocated node, started with srun
    KUBERNETES = (
        "kubernetes"  # a JobSet manifest (rewind.infra.launch.kubernetes); not started by the supervisor
    )


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one launch runs: one host per node (node 0 first), and its rendezvous on node 0."""

    hosts: tuple[str, ...]
    endpoint: str  # host:port of the c10d rendezvous
    allocation: str | None = None  # the scheduler's job id, where there is one


@dataclass(frozen=True, kw_only=True)
class Request:
    """What a launch needs: ``nnodes`` hosts, none of ``exclude``, as many of ``prefer`` as can be had."""

    run: str
    launch_id: int
    nnodes: int
    exclude: frozenset[str] = frozenset()
    prefer: tuple[str, ...] = ()
    endpoint: str | None = None  # the spec's own rdzv_endpoint, if it names one


class Launcher(Protocol):
    kind: LauncherKind

    def place(self, request: Request) -> Placement:
        """Hosts for the launch (waiting for the scheduler's grant, bounded)."""
        ...

    def node_command(self, placement: Placement, node: int, command: list[str]) -> list[str]:
        """The local command that runs ``command`` on node ``node`` of ``placement``."""
        ...

    def lost(self, placement: Placement) -> frozenset[str]:
        """The placed hosts the scheduler reports as gone (not responding, down, failed)."""
        ...

    def usable(self, exclude: frozenset[str]) -> int:
        """How many hosts a launch could be placed on now, leaving out ``exclude``."""
        ...

    def free(self) -> frozenset[str]:
        """The hosts the scheduler would give a launch at once (up, no job on them): the only ones a
        relaunch may ask for by name without waiting."""
        ...

    def cancel(self, placement: Placement, *, signal_name: str | None = None) -> None:
        """Signal every task of the placement (``signal_name``), or end the allocation (None)."""
        ...

    def settle_s(self) -> float:
        """How long the scheduler may take to call a lost host lost (its node timeout)."""
        ...


class LocalLauncher:
    """Every node a child process of the supervisor on this machine (tests, one big box)."""

    kind = LauncherKind.LOCAL

    def place(self, request: Request) -> Placement:
        host = socket.gethostname()
        return Placement(
            hosts=(host,) * request.nnodes, endpoint=request.endpoint or f"127.0.0.1:{free_port()}"
        )

    def node_command(self, placement: Placement, node: int, command: list[str]) -> list[str]:
        return command

    def lost(self, placement: Placement) -> frozenset[str]:
        return frozenset()

    def usable(self, exclude: frozenset[str]) -> int:
        return 1 << 30  # this machine's nodes are processes: as many as asked

    def free(self) -> frozenset[str]:
        return frozenset()  # one machine: no host to choose

    def cancel(self, placement: Placement, *, signal_name: str | None = None) -> None:
        return None  # the supervisor signals its own children

    def settle_s(self) -> float:
        return 0.0


def launcher_for(kind: str) -> Launcher:
    """The launcher a job spec names."""
    if kind == LauncherKind.SLURM:
        from rewind.infra.launch.slurm import SlurmLauncher

        return SlurmLauncher()
    return LocalLauncher()
