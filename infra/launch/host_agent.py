"""A host's memory agent on a multi-host launch: the process that passes the host's share of each committed
checkpoint round the peer ring (``infra/checkpoint/ring.py``), in place of the job's ranks.

    python -m rewind.infra.launch.host_agent [--node I] --nodes N --store HOST:PORT --scope ID -- COMMAND [ARG ...]

The scheduler's launcher runs this as each node's task (``srun``; a JobSet's pod, whose index is
``REWIND_NODE``). It makes a FIFO, starts the agent (a
grandchild, reaped by init once it ends; in a pod, whose first process the job becomes, it waits to be reaped
with the pod), and executes ``COMMAND`` (torchrun's agent) in its own place:
the task's pid, signals and exit status are the job's, untouched; when anything of that fails the job is
started all the same, without an agent. The agents of the launch's nodes meet at the TCP store node 0's
agent serves at ``--store`` (keys under ``--scope``, the launch's own) and make a gloo group of their own;
only then does an agent read its FIFO (``agent_notice.agent``). The job's ranks pass the ring themselves
unless every host's agent is listening when they start (each node's first rank waits for it at most
``send_on.AGENT_READY_S``) and at each save (agents that meet late take over then); otherwise each node's
first rank tells its agent of each
commit, the agents agree on each pass (``agent_rounds``) and pass the shares over their group, the agent on
rank 0's host recording the ring copies in the catalog, and each agent names the commit it last finished
beside its FIFO (a rank closing its checkpointer, or loading, waits for its last one while the agent
listens, bounded). A pass then takes none of the ranks' time or memory; their part is one small gather per
save.

An agent lives as long as its job: it ends when the job's process does (the recovery never waits for it,
and it holds the task's output no longer than the job), when told to (SIGTERM), or when it cannot work (no
memory tier, no store, a peer gone mid-pass or silent for ``agent_rounds.STALE_S``): then the ranks pass
from their next save on. A pass cut short leaves
an ``.incoming-<pid>`` directory the next pass sweeps; the previous ring copy stays. It runs at a lower
CPU priority than the job.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import shutil
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from rewind.infra.faults import fault_point
from rewind.infra.launch import agent_home
from rewind.infra.memory import agent_notice
from rewind.infra.memory.agent_notice import FIFO_ENV, Committed, Inbox
from rewind.infra.memory.agent_rounds import BEAT_S, STALE_S, Rounds, Seen

log = logging.getLogger("rewind.ring")
NODE_ENV = "REWIND_NODE"  # ``training.progress.NODE_ENV``, not imported: nothing heavy before the job starts
JOIN_S = 120.0  # the agents' store and group joined within this (``--join-s``), or this agent ends
PASS_TIMEOUT_S = 300.0  # one collective of a pass (a piece of 16 MiB, an agreement)
TICK_S = 0.2  # how often an agent looks for a decision while nothing is told
NICENESS = 10


def command(
    node: int | None, nodes: int, store: str, scope: str, job: list[str], *, join_s: float = JOIN_S
) -> list[str]:
    """The node's task: ``job`` run under its host's memory agent, by the job's own interpreter; ``node``
    None: the node's index is ``REWIND_NODE`` where the task runs (a pod's completion index); ``join_s``: how
    long the agents wait to meet (nodes that start apart, such as pods, need as long as the rendezvous). One
    node: ``job`` as it is (no peer to pass to, and it may not be torchrun at all)."""
    if nodes < 2:
        return job
    python = job[0] if Path(job[0]).name.startswith("python") else sys.executable
    where = [f"--node={node}"] if node is not None else []
    join = [f"--join-s={join_s:g}"] if join_s != JOIN_S else []
    return [python, "-m", "rewind.infra.launch.host_agent", *where, f"--nodes={nodes}", f"--store={store}",
            f"--scope={scope}", *join, "--", *job]  # fmt: skip


def _args(argv: list[str]) -> argparse.Namespace:
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="rewind-host-agent")
    parser.add_argument("--node", type=int, help=f"this node's index (default: ${NODE_ENV})")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument(
        "--store", required=True, help="HOST:PORT of the agents' store (node 0's agent serves it)"
    )
    parser.add_argument("--scope", default="", help="the launch's own: the store's keys are under it")
    parser.add_argument("--join-s", type=float, default=JOIN_S, help="how long the agents wait to meet")
    args = parser.parse_args(argv[:cut])
    args.job = argv[cut + 1 :]
    if (
        not args.job
        or not args.store.rpartition(":")[2].isascii()
        or not args.store.rpartition(":")[2].isdigit()
    ):
        parser.error("a store HOST:PORT and a command after -- are needed")
    return args


def _node(args: argparse.Namespace) -> int:
    """This node's index in 0..nodes-1 (``--node``, else ``REWIND_NODE``); OSError when there is none."""
    raw = str(args.node) if args.node is not None else os.environ.get(NODE_ENV, "")
    if not (raw.isascii() and raw.isdigit()) or not 0 <= int(raw) < args.nodes:
        raise OSError(f"no node index in 0..{args.nodes - 1} (--node or {NODE_ENV}: {raw!r:.20})")
    return int(raw)


def main(argv: list[str] | None = None) -> None:
    args = _args(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    try:
        args.node = _node(args)
        env[FIFO_ENV] = str(_start(args))
    except OSError as exc:  # the job starts all the same; its ranks pass the ring themselves
        print(f"memory agent not started: {exc}", file=sys.stderr)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; the job gets the defaults
        signal.signal(sig, signal.SIG_DFL)
    os.execvpe(args.job[0], args.job, env)


def _start(args: argparse.Namespace) -> Path:
    """The agent started (a grandchild: when it ends, init reaps it); its FIFO."""
    home = agent_home.made()
    fifo = home / "commits"
    try:
        os.mkfifo(fifo, 0o600)
        job = (_pidfd(), os.getpid())  # the job once this executes it: its pidfd opened before any fork
        middle = os.fork()
        if middle == 0:
            code = 1  # the agent not started: the job starts without it
            try:
                if os.fork() == 0:
                    _run(args, home, fifo, job)
                code = 0
            finally:
                os._exit(code)
        if os.waitstatus_to_exitcode(os.waitpid(middle, 0)[1]) != 0:
            raise OSError("the agent's process could not be started")
    except OSError:
        shutil.rmtree(home, ignore_errors=True)
        raise
    if job[0] >= 0:
        os.close(job[0])  # the agent's copy is its own
    return fifo


def _pidfd() -> int:
    """A pidfd of this process (close-on-exec), or -1 where there is none (Linux before 5.3)."""
    try:
        return os.pidfd_open(os.getpid())
    except (OSError, AttributeError):
        return -1


def _run(args: argparse.Namespace, home: Path, fifo: Path, job: tuple[int, int]) -> None:
    """The agent's whole life; it never returns."""

    def gone(*_: object) -> None:
        shutil.rmtree(home, ignore_errors=True)
        os._exit(0)

    try:
        signal.signal(signal.SIGTERM, gone)
        quiet = os.open(os.devnull, os.O_RDONLY)
        os.dup2(quiet, 0)  # the task's input is the job's
        os.close(quiet)
        threading.Thread(target=_watch, args=(*job, gone), daemon=True, name="rewind-job-watch").start()
        _agent(args, fifo)
    finally:
        gone()


def _watch(pidfd: int, pid: int, gone: Any) -> None:
    """Ends the agent when the job's process ends: its pidfd readable (the job is not the agent's parent), or,
    with no pidfd, its pid seen gone a few times a second."""
    if pidfd >= 0:
        select.select([pidfd], [], [])
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            while True:
                os.kill(pid, 0)
                time.sleep(0.2)
    gone()


def _agent(args: argparse.Namespace, fifo: Path) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"memory agent (node {args.node}): %(message)s")
    logging.getLogger("rewind").setLevel(logging.INFO)  # its own word; the libraries' warnings alone
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    from rewind.infra.checkpoint import ring
    from rewind.infra.memory import place

    try:
        if ring.setting() == "off" or place.config() is None:
            return
    except Exception as exc:  # ConfigError, an unreadable memory filesystem: the job goes on without
        log.warning("no memory tier on this host: %s", exc)
        return
    try:
        agent = HostAgent(args.node, args.nodes, args.store, args.scope, fifo, join_s=args.join_s)
    except Exception as exc:
        log.warning("the hosts' memory agents cannot meet at %s: %s; the ranks pass the ring", args.store,
                    _first(exc))  # fmt: skip
        return
    inbox = Inbox(fifo)  # listening from now on: the ranks tell it
    try:
        agent.serve(inbox)
    except Exception as exc:  # a peer gone mid-pass: no collective of the group can be trusted after it
        log.warning("stopped: %s; the ranks pass the ring from their next save", _first(exc))
    finally:
        inbox.close()


class HostAgent:
    """One host's agent: what its node's first rank told it, and the passes every agent agreed on."""

    def __init__(
        self, node: int, nodes: int, store: str, scope: str, fifo: Path, *, join_s: float = JOIN_S
    ) -> None:
        import torch.distributed as dist

        host, _, port = store.rpartition(":")
        tcp = dist.TCPStore(host, int(port), world_size=None, is_master=node == 0,
                            timeout=timedelta(seconds=join_s), wait_for_workers=False)  # fmt: skip
        self.rounds = Rounds(dist.PrefixStore(f"rewind/{scope}/rounds", tcp), node, nodes)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"rewind/{scope}/ring", tcp), rank=node,
                                world_size=nodes, timeout=timedelta(seconds=max(join_s, PASS_TIMEOUT_S)))  # fmt: skip
        self.tcp, self.node, self.nodes = tcp, node, nodes  # the store lives as long as the agent
        self.fifo = fifo
        self.done: dict[str, str] = {}  # run -> the id of its commit this agent last finished passing
        # the beat: on a connection of its own, from a thread of its own (a pass may take minutes)
        beat = Rounds(
            dist.PrefixStore(
                f"rewind/{scope}/rounds",
                dist.TCPStore(
                    host, int(port), world_size=None, is_master=False, timeout=timedelta(seconds=join_s)
                ),
            ),
            node,
            nodes,
        )
        threading.Thread(target=_beat, args=(beat,), daemon=True, name="rewind-agent-beat").start()
        self.told: dict[tuple[str, int], tuple[Committed, int]] = {}  # (run, step) -> newest word, how many
        self.held: dict[str, Any] = {}  # run -> this host's hold on its ring copies (``ring.hold``)
        self.catalogs: dict[str, Any] = {}  # where rank 0 records, by its address

    def serve(self, inbox: Inbox) -> None:
        """Every round, as it is decided, until the agent ends (or a peer is silent: it raises)."""
        n = 0
        looked = time.monotonic()
        while True:
            for notice in inbox.take(TICK_S):
                key = (notice.run, notice.step)
                told = self.told.get(key, (notice, 0))[1] + 1
                self.told[key] = (notice, told)
                self.rounds.publish(Seen(notice.run, notice.step, told))
            decided = self.rounds.decision(n)
            if decided is not None:
                mine = self._pass(decided)
                if mine is not None:  # whatever came of it: finished (the rank that told it waits for this)
                    self.done[mine.run] = mine.id
                    agent_notice.record_passed(self.fifo, self.done)
                n += 1
            if time.monotonic() - looked > BEAT_S:
                looked = time.monotonic()
                silent = self.rounds.silent()
                if silent:  # no round can be decided without it: the ranks pass from their next save
                    raise RuntimeError(f"the agent of node(s) {silent} silent for {STALE_S:.0f} s")

    def _pass(self, seen: Seen) -> Committed | None:
        """Collective over the agents: the commit ``seen`` passed round the ring (never raises for a local
        reason: every agent gathers whatever happened here); what this host was told of it."""
        import torch.distributed as dist

        from rewind.infra.checkpoint import ring

        fault_point("host_agent.pass", seen.step)
        mine = self.told.get((seen.run, seen.step), (None, 0))[0]
        every: list[Any] = [None] * self.nodes
        dist.all_gather_object(every, mine.shareable() if mine is not None else None)
        passed = None
        disks = _disks(every)
        if disks is not None and mine is not None:
            self._hold(mine.run)
            try:
                passed = ring.pass_on(Path(mine.directory), mine.run, disks, own=True)
            except Exception as exc:  # a peer gone mid-way: the gathering below fails too, and ends the agent
                log.warning("%s step %d not passed round the peer ring: %s", mine.run, seen.step, _first(exc))
        got = ring.gathered(passed)  # every agent, whatever happened above
        if mine is not None and passed is not None and passed.directory is not None:
            log.info("%s step %d passed: %d bytes sent, %d received", mine.run, seen.step, passed.sent,
                     passed.received)  # fmt: skip
        if mine is not None and mine.checkpoint_id is not None and got:
            made = {p.directory.name.rpartition("-")[2] for p in got if p.directory is not None}
            if (
                mine.digest is not None and made and made != {mine.digest[:16]}
            ):  # saved again since it was told
                log.warning("%s step %d: the ring copies made are not of the checkpoint told: not recorded",
                            mine.run, seen.step)  # fmt: skip
                self._register(mine, got, copies_made=False)  # what was let go for them is gone all the same
            else:
                self._register(mine, got)
        return mine

    def _hold(self, run: str) -> None:
        from rewind.infra.checkpoint import ring

        live = self.held.get(run)
        if live is None:
            self.held[run] = live = ring.hold(run)
        if live is not None:
            ring.renew(live)

    def _register(self, notice: Committed, passed: list[Any], *, copies_made: bool = True) -> None:
        """The agent rank 0 told: the ring copies made (``copies_made``), and other runs' let go to make room
        for them, recorded in the catalog (told, never raised)."""
        from rewind.infra.catalog.db import Catalog
        from rewind.infra.checkpoint import ring

        assert notice.checkpoint_id is not None
        if notice.catalog is None:  # an in-memory catalog (or an address too long to tell)
            return
        try:
            cat = self.catalogs.get(notice.catalog)
            if cat is None:  # rank 0 made it current: nothing to upgrade
                cat = self.catalogs[notice.catalog] = Catalog(notice.catalog, auto_upgrade=False)
            if copies_made:
                ring.register(cat, notice.checkpoint_id, notice.run, passed)
            else:
                ring.record_evicted(cat, notice.run, passed)
        except Exception as exc:
            log.warning("%s step %d: the peer ring's copies not recorded: %s", notice.run, notice.step,
                        _first(exc))  # fmt: skip


def _beat(rounds: Rounds) -> None:
    """This agent's beat, every ``BEAT_S``, while it lives (a store gone ends it: so does the agent)."""
    with contextlib.suppress(Exception):
        while True:
            rounds.beat()
            time.sleep(BEAT_S)


def _disks(every: list[Committed | None]) -> Any:
    """The disks of every host's first rank, when every host was told of the same run's step; else None."""
    from rewind.infra.checkpoint.spread import Disks
    from rewind.infra.format.local_tier import LocalTier

    told = [n for n in every if n is not None]
    if len(told) != len(every) or len({(n.run, n.step) for n in told}) != 1:
        return None
    return Disks(tuple(LocalTier(n.disk, n.host) for n in told))


def _first(exc: BaseException) -> str:
    """An error's first line (torch's store errors carry their C++ stack after it)."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


if __name__ == "__main__":
    main()
