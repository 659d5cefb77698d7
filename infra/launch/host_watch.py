"""The supervisor's eye on a launch's hosts: the scheduler asked every ``check_s`` which placed hosts it
now calls lost (not responding, down). A host lost is one observation naming it and its node, once.

A launch on this machine alone (the ``local`` launcher) has no hosts to lose: nothing is asked.
"""

from __future__ import annotations

import logging
import time

from rewind.infra.errors import TransientError
from rewind.infra.launch.launchers import Launcher, LauncherKind, Placement
from rewind.infra.launch.observe import Observation, Seen

log = logging.getLogger("rewind.supervisor")


class HostWatch:
    def __init__(self, launcher: Launcher, check_s: float) -> None:
        self.launcher, self.check_s = launcher, check_s
        self.placement: Placement | None = None  # set once the launch's hosts are granted
        self.lost: dict[str, int] = {}  # host -> node, as the scheduler reported them
        self.lost_at: dict[str, float] = {}  # host -> when the scheduler was first seen calling it lost
        self._next = 0.0

    @property
    def watching(self) -> bool:
        return self.placement is not None and self.launcher.kind is not LauncherKind.LOCAL

    def observe(self, now: float, *, at_once: bool = False) -> list[Observation]:
        """A placed host the scheduler now reports gone: once per host (``at_once``: whatever the interval)."""
        if self.placement is None or not self.watching or (time.monotonic() < self._next and not at_once):
            return []
        self._next = time.monotonic() + self.check_s
        try:
            lost = self.launcher.lost(self.placement)
        except TransientError as exc:  # the scheduler blinked: the next check asks again
            log.warning("could not ask the scheduler for node states: %s", exc)
            return []
        out = []
        for host in sorted(lost - set(self.lost)):
            node = self.placement.hosts.index(host)
            self.lost[host] = node
            self.lost_at[host] = now
            why = f"host {host} (node {node}) lost: the scheduler reports it not responding or down"
            out.append(Observation(Seen.HOST_LOST, now, None, {"host": host, "node": node, "reason": why}))
        return out

    def settle(self, nodes: int) -> None:
        """After a failed launch of several hosts: give the scheduler its node timeout to call a host lost.

        A lost host's step can end (srun gives up on it) before the scheduler has noticed the host is
        gone; relaunching onto it would fail again. Ends as soon as a host is called lost."""
        if not self.watching or nodes < 2:
            return
        try:
            deadline = time.monotonic() + self.launcher.settle_s()
        except TransientError as exc:
            log.warning("could not read the scheduler's node timeout: %s", exc)
            return
        while not self.lost and time.monotonic() < deadline:
            self.observe(time.time(), at_once=True)
            time.sleep(0.5)

    def release(self) -> None:
        """The allocation given back (its nodes free for the relaunch); a failure to is said, not raised."""
        if self.placement is None or not self.watching:
            return
        try:
            self.launcher.cancel(self.placement)
        except TransientError as exc:
            log.warning("could not release allocation %s: %s", self.placement.allocation, exc)
