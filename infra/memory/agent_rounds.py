"""How the hosts' memory agents agree on each pass of the peer ring: rounds decided through a TCP store.

Every agent publishes the newest commit it was told of (``seen/<node>``: the run, the step and how many
times that step was told, so that a step saved again is passed again). Round ``n``'s decision is set once
(``compare_set`` under ``round/<n>``) by node 0's agent, when every agent has published the same commit and
it is not the one last decided: only the newest every host has (a pass still running when several commits
came passes the newest of them next). Every agent reads the same decisions in the same order, so that every
agent enters the same collectives in the same order. Nothing here blocks: an agent polls (the store's own
waits log a warning at every timeout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the agent's task before it starts the job: no torch here
    import torch.distributed as dist


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
        self.last: str | None = None  # node 0: the commit last decided

    def publish(self, seen: Seen) -> None:
        self.store.set(f"seen/{self.node}", seen.value())

    def decision(self, n: int) -> Seen | None:
        """Round ``n``'s decision once made; node 0 makes it when it can."""
        key = f"round/{n}"
        if self.node == 0:
            proposal = self._proposal()
            if proposal is not None:
                self.last = self.store.compare_set(key, "", proposal).decode()
                return Seen.parse(self.last.encode())
        if self.store.check([key]):
            return Seen.parse(self.store.get(key))
        return None

    def _proposal(self) -> str | None:
        keys = [f"seen/{i}" for i in range(self.nodes)]
        if not self.store.check(keys):  # an agent not told of anything yet: nothing is passed without it
            return None
        every = {self.store.get(k).decode() for k in keys}
        if len(every) != 1:  # some host not told of the newest commit yet (or told of none of the others')
            return None
        (seen,) = every
        return seen if seen != self.last else None
