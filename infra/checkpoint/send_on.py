"""Where a committed multi-rank checkpoint goes next, decided the same way on every rank: each disk's share
to the shared tier (``share_push``, in the background) and round the peer ring into the hosts' memory
(``ring``). Neither ever fails a save: the checkpoint is committed before either starts.

Both run off the job's path unless asked otherwise: the share push on a sender thread of its own, the ring's
pass in an async save's background persist, or, after a sync save, on the rank's background runner (every
rank runs every pass, in order: the next save waits for a pass still running before it writes anything, so
that the ranks' collectives never differ and a pass never reads a step a later save replaces; the wait lands
in a save's stall only when passes take longer than the interval between saves). ``REWIND_MEMORY_RING=on``
passes a sync save's shares inside the save instead."""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import ring, share_push
from rewind.infra.checkpoint.background import BackgroundRunner
from rewind.infra.checkpoint.spread import Disks
from rewind.infra.faults import fault_point
from rewind.infra.format import store
from rewind.infra.memory import agent_notice

log = logging.getLogger("rewind.sharded")
LAUNCHER_ENV = "REWIND_LAUNCHER"  # the launcher a supervisor started the job with (``local``, ``slurm``)


class SendOn:
    """Collective to make (every rank, the same order): what this rank sends on after each commit."""

    def __init__(
        self,
        run: str,
        run_dir: Path,
        disks: Disks,
        *,
        catalog: Catalog | None,
        exit_timeout_s: float,
        background: bool,
        behind: BackgroundRunner | None = None,
    ) -> None:
        """``catalog``: where a disk's leader registers a shared copy it completes (rank 0's; another
        rank's only under a supervisor). A disk's leader sends its share to the shared tier itself when
        nothing else can read its disk: the checkpoint is spread over hosts' disks, or the job runs on a
        scheduler's hosts. ``background``: saves persist in the background (async), where the ring's pass
        is off the job's path (the next save waits for it only if it is still running). ``behind``: a
        sync save's runner for work after it returned, the ring's pass (not when ``REWIND_MEMORY_RING=on``:
        then inside the save)."""
        self.run, self.run_dir, self.disks = run, run_dir, disks
        self.rank = dist.get_rank()
        self.exit_timeout_s = exit_timeout_s
        remote_hosts = os.environ.get(LAUNCHER_ENV, "local") != "local"
        shared = bool(os.environ.get(share_push.SHARED_ENV, "").strip())
        self.push = shared and (disks.spread or remote_hosts)  # the same on every rank
        leads = disks.leads(self.rank)
        self.pusher = share_push.SharePusher.from_env(catalog) if self.push and leads else None
        # each host's share also kept in the next host's memory
        self.ring = ring.enabled(disks)
        inside = (
            not background and self.ring and ring.setting() == "on"
        )  # a valid setting: ``enabled`` read it
        self.behind = behind if self.ring and not background and not inside else None
        self.own = not inside  # a host's own files kept in its memory too: only off the job's path
        # the ring's bytes go over a gloo group of its own (CPU tensors, whatever the job's backend); made
        # under the hosts' agents too: the ranks pass again should the agents go
        self.ring_group = dist.new_group(backend="gloo") if self.ring else None
        # every host's memory agent passes instead (``host_agent``), unless the save must wait for the pass
        self.teller = os.environ.get("LOCAL_RANK") == "0"  # each node's first rank tells its host's agent
        self._last_told: str | None = None  # the id of the last commit told
        seen = _agents_seen(self.teller, None) if self.ring and not inside else AgentsSeen(False, False)
        self.agent = seen.ready
        self._ask = seen.ready or seen.hopeful  # asked again at each save: agents meeting late take over
        # while this leader lives, another run's pass never lets this run's ring copies here go (held
        # whenever they may be read: a restore reads them even when this launch passes none)
        self._holds = disks.spread and leads
        self.ring_hold = ring.hold(run) if self._holds else None

    def after_commit(
        self,
        step: int,
        group: dist.ProcessGroup | None,
        lead: Catalog | None,
        checkpoint_id: int | None,
        *,
        digest: str | None = None,
    ) -> None:
        """Collective after the commit of ``step`` (``lead``, ``checkpoint_id``, ``digest``: rank 0's catalog,
        row and manifest digest)."""
        self._pushed(step, group, lead, checkpoint_id)
        if not self.ring:
            return
        if self._ask and self._agents_pass(step, group):  # each node's first rank only tells its own
            self._tell(step, lead, checkpoint_id, digest)
            return
        if self.behind is None:
            self._passed(step, lead, checkpoint_id)
        else:  # the save waited for the previous pass: the same passes in the same order on every rank
            self.behind.submit(f"ring pass of step {step}", lambda: self._passed(step, lead, checkpoint_id))

    def _agents_pass(self, step: int, group: dist.ProcessGroup | None) -> bool:
        """Collective: whether the hosts' memory agents pass ``step`` (every one listening now). The ranks'
        own pass of the step before has ended by now (a save waits for it), and the agents' is waited for
        before the ranks take over, so either hand-over is clean."""
        was = self.agent
        seen = _agents_seen(self.teller, group, wait_s=0.0)
        self.agent, self._ask = seen.ready, seen.ready or seen.hopeful
        if not self.agent:  # the ranks pass from now on, once this host's agent finished what it was told
            self.settle()  # (bounded; not at all once it stopped listening): no older pass lands after theirs
        if self.agent != was and self.rank == 0:
            log.warning("%s: %s pass the peer ring from step %d on", self.run,
                        "the hosts' memory agents" if self.agent else "a host's memory agent is not listening: the ranks",
                        step)  # fmt: skip
        return self.agent

    def _tell(self, step: int, lead: Catalog | None, checkpoint_id: int | None, digest: str | None) -> None:
        """A node's first rank tells its host's agent of the commit; rank 0 also where the ring copies are
        recorded."""
        if not self.teller:
            return
        disk = self.disks.of_rank[self.rank]
        directory = store.step_dir(self.run_dir, step)
        url = (
            lead.url.render_as_string(hide_password=False)
            if lead is not None and not lead.in_memory
            else None
        )
        notice = agent_notice.Committed(run=self.run, step=step, directory=str(directory), disk=disk.id,
                                        host=disk.host, id=uuid.uuid4().hex, checkpoint_id=checkpoint_id,
                                        digest=digest, catalog=url)  # fmt: skip
        if agent_notice.tell(notice):
            self._last_told = notice.id

    def _passed(self, step: int, lead: Catalog | None, checkpoint_id: int | None) -> None:
        """Collective over the ring's group: the checkpoint of ``step`` passed round the ring. Never raises:
        a pass on a background runner that raised would fail the next save on this rank alone."""
        try:
            fault_point("ring.pass", step)
            self._pass(step, lead, checkpoint_id)
        except Exception as exc:  # logged: the disks' copies are the ones counted on
            log.warning("%s step %d not passed round the peer ring: %s", self.run, step, exc)

    def _pass(self, step: int, lead: Catalog | None, checkpoint_id: int | None) -> None:
        if self.ring_hold is not None:
            ring.renew(self.ring_hold)
        elif self._holds:  # not had at the start (its lock busy, say): taken now, or at the next pass
            self.ring_hold = ring.hold(self.run)
        mine = None
        try:
            directory = store.step_dir(self.run_dir, step)
            mine = ring.pass_on(directory, self.run, self.disks, self.ring_group, own=self.own)
        except Exception as exc:  # a peer gone mid-way: the disks' copies are the ones counted on
            log.warning("%s step %d not passed round the peer ring: %s", self.run, step, exc)
        try:
            passed = ring.gathered(mine, self.ring_group)  # every rank, whatever happened above
            if lead is not None and checkpoint_id is not None and passed:
                ring.register(lead, checkpoint_id, self.run, passed)
        except Exception as exc:
            log.warning("%s step %d: the peer ring's copies not recorded: %s", self.run, step, exc)

    def _pushed(
        self, step: int, group: dist.ProcessGroup | None, lead: Catalog | None, checkpoint_id: int | None
    ) -> None:
        """The checkpoint goes to the shared tier if every host's sender is free; to the step's other key
        when rank 0's catalog lists the step's own key for another checkpoint's copy."""
        if not self.push:
            return
        taken = (
            self.pusher is not None
            and lead is not None
            and checkpoint_id is not None
            and self.pusher.step_key_taken(lead, checkpoint_id, self.run, step)
        )
        go, avoid = share_push.decide(self.pusher is None or self.pusher.idle, taken, group=group)
        if go and self.pusher is not None:
            disk = self.disks.of_rank[self.rank].id
            directory = store.step_dir(self.run_dir, step)
            self.pusher.submit(share_push.Share(self.run, step, directory, disk, with_common=self.rank == 0,
                                                avoid_step_key=avoid))  # fmt: skip

    def settle(self) -> None:
        """Wait (bounded) for the host's memory agent to finish passing the last commit told: before a load
        (no ring copy is replaced under it) and at close (the job's end does not cut the pass short)."""
        if self._last_told is not None and not _agent_passed(self.run, self._last_told, self.exit_timeout_s):
            log.warning(
                "%s: the memory agent has not passed the last checkpoint round the peer ring", self.run
            )
        self._last_told = None

    def close(self) -> None:
        """Wait (bounded) for the host's memory agent's last pass, and a share still on its way to the shared
        tier; this run's ring copies on this host are another run's to let go from now on, when it needs
        their room."""
        self.settle()
        if self.ring_hold is not None:
            self.ring_hold.close()
        if self.pusher is not None and not self.pusher.wait(self.exit_timeout_s):
            log.warning("%s: a share still on its way to the shared tier after %.0f s", self.run,
                        self.exit_timeout_s)  # fmt: skip


AGENT_READY_S = 15.0  # how long a node's first rank waits, at the job's start, for its host's agent


@dataclass(frozen=True, slots=True)
class AgentsSeen:
    """What every node's first rank found of its host's memory agent."""

    ready: bool  # every one listening: the agents pass
    hopeful: bool  # none ended (some may still be meeting the others): worth asking again at the next save


def _agents_seen(teller: bool, group: dist.ProcessGroup | None, wait_s: float = AGENT_READY_S) -> AgentsSeen:
    """Collective: whether every node's memory agent is listening (each node's first rank looks, waiting at
    most ``wait_s`` for one still meeting the others; the same answer on every rank: where one is not, the
    ranks pass)."""
    state = agent_notice.Agent.GONE
    if teller:
        deadline = time.monotonic() + wait_s
        while (state := agent_notice.agent()) is agent_notice.Agent.STARTING and time.monotonic() < deadline:
            time.sleep(0.1)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (teller, state.value), group=group)
    told = [agent_notice.Agent(s) for t, s in every if t]
    return AgentsSeen(
        ready=bool(told) and all(s is agent_notice.Agent.LISTENING for s in told),
        hopeful=bool(told) and agent_notice.Agent.GONE not in told,
    )


def _agent_passed(run: str, told: str, timeout_s: float) -> bool:
    """Whether this host's agent finished passing ``run``'s commit it was told of as ``told``, waiting at most
    ``timeout_s`` while it listens (an agent that ended, however, is not waited for)."""
    deadline = time.monotonic() + timeout_s
    while agent_notice.passed(run) != told:
        if agent_notice.agent() is not agent_notice.Agent.LISTENING or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
