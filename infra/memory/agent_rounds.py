"""How the hosts' memory agents agree on each pass of the peer ring: rounds decided through a TCP store.

Every agent publishes the newest commit of each run it was told of (``seen/<node>``: per run, the step and
how many times that step was told, so that a step saved again is passed again). Round ``n``'s decision is set
once (``compare_set`` under ``round/<n>``) by node 0's agent: the first run whose newest commit every agent
has published alike and that is not the one last decided for it (only the newest every host has: a pass
still running when several commits came passes the newest of them next). Every agent reads the same
decisions in the same order, so that every agent enters the same collectives in the same order. Each agent
also beats (``alive/<node>``, from a thread of its own, on a connection of its own): an agent whose peer has
not beaten for ``STALE_S`` gives up (the ranks pass from their next save, and none waits for a round that
cannot be decided). Nothing here blocks: an agent polls (the store's own waits log a warning at every
timeout).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the agent's task before it starts the job: no torch here
    import torch.distributed as dist

BEAT_S = 1.0  # how often an agent beats
STALE_S = 30.0  # a peer silent this long is gone


@dataclass(frozen=True, slots=True)
class Seen:
    """A commit as the agents name it: the run, the step, and the how-manieth word of that step."""

    run: str
    step: int
    told: int

    def value(self) -> str:
        return json.dumps([self.run, self.step, self.told])

    @classmethod
    def parse(cls, raw: bytes) -> Seen:
        run, step, told = json.loads(raw)
        return cls(str(run), int(step), int(told))


class Rounds:
    def __init__(self, store: dist.Store, node: int, nodes: int) -> None:
        self.store, self.node, self.nodes = store, node, nodes
        self.newest: dict[str, tuple[int, int]] = {}  # run -> (step, times told) of its newest commit here
        self.last: dict[str, str] = {}  # node 0: run -> the commit last decided
        self.beats: dict[int, tuple[int, float]] = {}  # node -> its last beat seen, and when (this clock)

    def publish(self, seen: Seen) -> None:
        self.newest[seen.run] = (seen.step, seen.told)
        self.store.set(f"seen/{self.node}", json.dumps(self.newest, sort_keys=True))

    def decision(self, n: int) -> Seen | None:
        """Round ``n``'s decision once made; node 0 makes it when it can."""
        key = f"round/{n}"
        if self.node == 0:
            proposal = self._proposal()
            if proposal is not None:
                decided = Seen.parse(self.store.compare_set(key, "", proposal.value()))
                self.last[decided.run] = decided.value()
                return decided
        if self.store.check([key]):
            return Seen.parse(self.store.get(key))
        return None

    def _proposal(self) -> Seen | None:
        keys = [f"seen/{i}" for i in range(self.nodes)]
        if not self.store.check(keys):  # an agent not told of anything yet: nothing is passed without it
            return None
        every: list[dict[str, list[int]]] = [json.loads(self.store.get(k)) for k in keys]
        for run in sorted(set().union(*every)):
            newest = {(e[run][0], e[run][1]) if run in e else (-1, 0) for e in every}
            if len(newest) != 1 or (-1, 0) in newest:  # some host not told of the run's newest commit yet
                continue
            ((step, told),) = newest
            seen = Seen(run, step, told)
            if self.last.get(run) != seen.value():
                return seen
        return None

    def beat(self) -> None:
        """This agent's beat (from its own thread and store connection)."""
        self.store.add(f"alive/{self.node}", 1)

    def silent(self) -> list[int]:
        """The peers that have not beaten for ``STALE_S`` (by this agent's clock, from when it first looked)."""
        now = time.monotonic()
        gone = []
        for i in range(self.nodes):
            if i == self.node:
                continue
            beat = self.store.add(f"alive/{i}", 0)
            last = self.beats.get(i)
            if last is None or last[0] != beat:
                self.beats[i] = (beat, now)
            elif now - last[1] > STALE_S:
                gone.append(i)
        return gone
