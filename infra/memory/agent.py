"""The node's memory agent: a process beside the job's (not one of them) that copies each checkpoint the
supervisor sees committed into the memory tier, so a crash of the job's processes leaves it intact.

``python -m rewind.infra.memory.agent RUN``: checkpoint ids come one per line on stdin (the supervisor
writes each it sees committed; when several wait, only the newest is copied); it ends when stdin closes
(the supervisor finished or died), after the copy in progress. ``release`` on a line of its own last:
the run's memory copies are let go and it ends, copying nothing offered with it (the run finished: nothing
left to come back to). It
runs at a lower CPU priority than the job, whose compute it must not take.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import select
import sys
from collections.abc import Iterator
from typing import TextIO

from rewind.infra.catalog import copies, held, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import RewindError
from rewind.infra.memory import keeper, place

log = logging.getLogger("rewind.memory")
RELEASE = "release"
NICENESS = 10


def batches(stream: TextIO) -> Iterator[list[str]]:
    """The lines on ``stream``, as many as are waiting at a time; ends at end of file. Read from its file
    descriptor, not through its buffer (which would hide from ``select`` the lines it already holds)."""
    fd, pending, ended = stream.fileno(), b"", False
    while not ended:
        got = os.read(fd, 1 << 16)
        ended = not got
        pending += got
        while not ended and select.select([fd], [], [], 0)[0]:
            more = os.read(fd, 1 << 16)
            ended = not more
            pending += more
        *lines, pending = pending.split(b"\n")
        if ended and pending:
            lines, pending = [*lines, pending], b""
        if lines:
            yield [x.decode(errors="replace").strip() for x in lines]


def release(cat: Catalog, cfg: place.MemoryConfig, run: str) -> int:
    """Let go of the run's memory copies; how many."""
    here = keeper.mark(cfg)
    gone = 0
    for h in held.held_on(cat, copies.MEMORY, here.id):
        if h.run == run and not h.ring:  # the peer ring's copies are its own to let go
            copies.record(cat, h.replica_id, R.DELETED, "let go from the memory tier: the run finished")
            keeper.remove(h.uri)
            gone += 1
    return gone


def serve(cat: Catalog, cfg: place.MemoryConfig, run: str, stream: TextIO) -> None:
    """Copy each newest checkpoint offered; the newest the run has when it starts, first."""
    newest = lineage.newest_restorable(cat, lineage.get_run(cat, run).id)
    offered: list[str] = [str(newest.id)] if newest is not None else []
    for lines in itertools.chain([offered], batches(stream)):  # each batch as it comes, not at the end
        if RELEASE in lines:  # the last word: the run finished, nothing of it is copied after
            release(cat, cfg, run)
            return
        ids = [int(x) for x in lines if x.isdigit()]
        if ids:
            _keep(cat, cfg, max(ids))


def _keep(cat: Catalog, cfg: place.MemoryConfig, checkpoint_id: int) -> None:
    try:
        kept = keeper.keep(cat, checkpoint_id, cfg)
    except (RewindError, OSError) as exc:  # the job goes on; its disk copies are what it counts on
        log.warning("checkpoint %d not copied into the memory tier: %s", checkpoint_id, exc)
        return
    if kept is not None:
        log.info("step %d held in memory (%d bytes, %.2f s)", kept.step, kept.nbytes, kept.seconds)


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(prog="rewind-memory-agent").parse_known_args(argv)[1]
    if len(args) != 1:
        print("usage: python -m rewind.infra.memory.agent RUN", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="memory agent: %(message)s")
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    cfg = place.config()
    if cfg is None:
        return 0
    serve(Catalog(), cfg, args[0], sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
