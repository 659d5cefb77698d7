"""The hosts' memory agents of a multi-host launch (``infra/launch/host_agent.py``): two "hosts" on this
machine, each a torchrun of 2 ranks (its own disk and memory tier) started under its agent, as the Slurm
launcher starts each node. The agents pass the peer ring in place of the ranks (a rank reaching the ranks'
own pass would be killed): each host's memory gets its peer's share, recorded in the catalog, and with host
b gone the job restores on a spare from a's memory alone; agents that cannot meet leave the ranks to pass
themselves. The agents' rounds are checked against a real TCP store, their FIFO against hostile lines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.format import local_tier, pids
from rewind.infra.format import manifest as mf
from rewind.infra.launch import host_agent
from rewind.infra.memory import agent_notice, agent_rounds
from rewind.infra.memory.agent_rounds import Rounds, Seen
from rewind.infra.net import free_port
from tests.prefect_support import wait_until
from tests.spread_worker import RUN
from tests.test_spread import restored_without_host_b

REPO = Path(__file__).resolve().parents[1]


def _marked(work: Path) -> None:
    """Disks and memory tiers a and b, each marked as its host's (host-a, host-b)."""
    for place in ("disks", "memory"):
        for d in "ab":
            root = work / place / d
            root.mkdir(parents=True)
            mark = {"id": f"{place}-{d}-{work.name}", "host": f"host-{d}"}
            (root / local_tier.MARK).write_text(json.dumps(mark), encoding="utf-8")


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _agents_of(store: str) -> list[int]:
    """The pids of the agents meeting at ``store`` (the jobs took their tasks' pids: only agents match)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rewind.infra.launch.host_agent" in argv and f"--store={store}".encode() in argv:
            found.append(int(proc.name))
    return found


def _hosts_under_agents(
    work: Path,
    stores: tuple[str, str],
    extra: dict[str, str] | None = None,
    *,
    join_s: float = host_agent.JOIN_S,
) -> list[subprocess.Popen[str]]:
    """Host a (node 0: ranks 0-1) and host b (node 1: ranks 2-3), each its torchrun under its agent (node
    0's store, as each agent is told it: ``stores``); sync saves, the ring's setting at its default."""
    master = free_port()
    nodes = []
    for node, disk in enumerate("ab"):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "REWIND_TEST_RING": "1",
               "REWIND_MEMORY_ROOT": str(work / "memory" / disk), **(extra or {})}  # fmt: skip
        for name in ("REWIND_SHARED_URI", "REWIND_MEMORY_RING", "REWIND_TEST_ASYNC"):
            env.pop(name, None)
        job = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={master}",
               "-m", "tests.spread_worker", "save", str(work), "a,a,b,b"]  # fmt: skip
        task = host_agent.command(node, 2, stores[node], "launch-1", job, join_s=join_s)
        nodes.append(subprocess.Popen(task, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
    return nodes


def _ended(nodes: list[subprocess.Popen[str]], timeout_s: float) -> list[str]:
    """Every node's output once it ended, within ``timeout_s`` each; past that every node is killed, its
    ranks and agent too (each node a session of its own), and the wait's error raised."""
    try:
        return [p.communicate(timeout=timeout_s)[0] for p in nodes]
    except subprocess.TimeoutExpired:
        for p in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        raise


def _saved_under_agents(
    work: Path, stores: tuple[str, str], extra: dict[str, str] | None = None
) -> list[str]:
    """The job run to its end under the agents; every node's output. The agents end with it."""
    _marked(work)
    nodes = _hosts_under_agents(work, stores, extra)
    outs = _ended(nodes, 240)
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outs)
    for store in set(stores):
        wait_until(lambda s=store: not _agents_of(s), 30, "the agents ended with the job", interval=0.1)
    return outs


def _ring_rows(work: Path) -> set[tuple[str | None, str | None, str]]:
    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    (step2,) = lineage.checkpoints(cat, RUN, step=2)
    return {(r.host, r.key, r.status) for r in lineage.replicas_of(cat, step2.id) if r.tier == "memory"}


@pytest.mark.timeout(300)
def test_the_hosts_agents_pass_the_ring_and_the_ranks_never_do(tmp_path: Path) -> None:
    """A rank that reached the ranks' own pass would be killed there: none does. The job ends right after its
    last save (its ranks' close waits for their agents to finish passing it; the agents end with the job), and
    each host's memory holds its peer's share of step 2 (and its own files), recorded in the catalog; with
    host b gone, a spare restores from a's memory alone."""
    work = tmp_path
    store = f"127.0.0.1:{free_port()}"
    _saved_under_agents(work, (store, store), {"REWIND_FAULT": "kill:ring.pass"})
    assert _ring_rows(work) == {("host-a", "ring:host-b", "verified"), ("host-b", "ring:host-a", "verified")}
    ma = mf.read(work / "disks" / "a" / RUN / "step-2")
    whole = {e.path: e.size for e in ma.files}
    for disk in "ab":  # each memory: its peer's share and its own files, the manifest last
        (copy,) = (work / "memory" / disk / ".ring" / RUN).glob("step-2-*")
        assert (copy / mf.MANIFEST_NAME).read_bytes() == ma.to_bytes()
        assert {p.name: p.stat().st_size for p in copy.iterdir() if p.name != mf.MANIFEST_NAME} == whole

    restored_without_host_b(work, ma)


def _held_at(point: str, work: Path, store: str, release: Path) -> list[subprocess.Popen[str]]:
    """The job under agents held at ``point`` (until ``release`` exists), once they are held there and the
    job has written its results (its saves done and told)."""
    _marked(work)
    nodes = _hosts_under_agents(work, (store, store), {"REWIND_FAULT": f"hold:{point}",
                                                        "REWIND_FAULT_RELEASE": str(release)})  # fmt: skip
    try:
        wait_until(lambda: Path(f"{release}.held").exists() and (work / "expected.safetensors").exists(), 120,
                   "the agents held and the job's results written", interval=0.05)  # fmt: skip
    except BaseException:
        release.touch()
        _ended(nodes, 60)
        raise
    return nodes


@pytest.mark.timeout(300)
def test_a_job_ending_right_after_its_last_save_waits_for_the_agents_to_pass_it(tmp_path: Path) -> None:
    """The agents held at step 2's pass until the job has written its results: the ranks' close waits for
    their agents (the agents end with the job), so step 2's ring copies are made and recorded all the same."""
    work = tmp_path
    store, release = f"127.0.0.1:{free_port()}", work / "release"
    nodes = _held_at("host_agent.pass@2", work, store, release)
    try:
        with pytest.raises(TimeoutError):  # the job waits for its agents in close: it does not end meanwhile
            wait_until(lambda: any(p.poll() is not None for p in nodes), 3, "a node ending", interval=0.05)
    finally:
        release.touch()
    outs = _ended(nodes, 240)
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outs)
    assert _ring_rows(work) == {("host-a", "ring:host-b", "verified"), ("host-b", "ring:host-a", "verified")}


@pytest.mark.timeout(300)
def test_an_agent_killed_mid_launch_is_not_waited_for(tmp_path: Path) -> None:
    """Host b's agent SIGKILLed while both agents are held at their first pass (both steps told by then): host
    a's agent fails the pass and ends, and neither host's first rank waits for its agent at close (a killed
    agent leaves its FIFO without a reader): the job ends at once, not after the checkpointer's 300 s."""
    work = tmp_path
    store, release = f"127.0.0.1:{free_port()}", work / "release"
    nodes = _held_at("host_agent.pass", work, store, release)
    try:
        (agent_b,) = [pid for pid in _agents_of(store) if "--node=1" in _argv(pid)]
        os.kill(agent_b, signal.SIGKILL)
    finally:
        release.touch()
    outs = _ended(nodes, 60)
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outs)
    wait_until(lambda: not _agents_of(store), 30, "host a's agent ended", interval=0.1)


@pytest.mark.timeout(300)
def test_with_a_hosts_agent_unable_to_meet_the_others_the_ranks_pass_the_ring_themselves(
    tmp_path: Path,
) -> None:
    """Host b's agent is given a store where nothing listens: no agent ever listens, the ranks find out at
    their start (bounded) and pass the ring themselves; the job ends as it would have without agents."""
    work = tmp_path
    outs = _saved_under_agents(work, (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"))
    assert _ring_rows(work) == {("host-a", "ring:host-b", "verified"), ("host-b", "ring:host-a", "verified")}
    assert not any("memory agent (node 0)" in line and "passed" in line for line in outs[0].splitlines())


@pytest.mark.parametrize("node", ["1", "", "7"])
def test_a_pods_index_is_its_node_and_without_one_the_job_starts_without_an_agent(node: str) -> None:
    """A JobSet's pod names its node in ``REWIND_NODE``; with none there (or one out of range) the job starts
    all the same, without an agent (its ranks pass the ring themselves)."""
    job = [sys.executable, "-c", "import os; print(os.environ.get('REWIND_HOST_AGENT', 'no agent'))"]
    env = {**os.environ, "REWIND_NODE": node, "REWIND_MEMORY_RING": "off"}  # an agent started ends at once
    done = subprocess.run(host_agent.command(None, 2, f"127.0.0.1:{free_port()}", "s", job), env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    if node == "1":
        assert done.stdout.strip().endswith("/commits") and not done.stderr
    else:
        assert done.stdout.strip() == "no agent" and "memory agent not started: no node index" in done.stderr


def _rounds(nodes: int) -> tuple[dist.TCPStore, list[Rounds]]:
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    return master, [Rounds(dist.PrefixStore("rounds", master), i, nodes) for i in range(nodes)]


def test_one_runs_commits_never_wait_for_anothers() -> None:
    _store, (zero, one) = _rounds(2)
    zero.publish(Seen("x", 5, 1))
    zero.publish(Seen("y", 7, 1))
    one.publish(Seen("y", 7, 1))  # node 1 not told of x's commit yet: y's is passed meanwhile
    assert zero.decision(0) == Seen("y", 7, 1) and one.decision(0) == Seen("y", 7, 1)
    one.publish(Seen("x", 5, 1))
    assert zero.decision(1) == Seen("x", 5, 1)


def test_an_agent_gives_up_on_a_peer_that_stopped_beating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_rounds, "STALE_S", 0.3)
    _store, (zero, one) = _rounds(2)
    one.beat()
    assert zero.silent() == []  # first look: node 1's beat seen now
    wait_until(lambda: zero.silent() == [1], 10, "node 1 called silent", interval=0.05)
    one.beat()
    assert zero.silent() == []  # it beat again: not silent


def test_a_round_passes_the_newest_commit_every_host_was_told_of_once() -> None:
    _store, (zero, one) = _rounds(2)
    zero.publish(Seen("r", 20, 1))
    assert zero.decision(0) is None and one.decision(0) is None  # node 1 told of nothing yet: nothing passed
    one.publish(Seen("r", 10, 1))
    assert zero.decision(0) is None  # the hosts were told of different commits: each waits for the other's
    one.publish(Seen("r", 20, 1))
    assert zero.decision(0) == Seen("r", 20, 1) and one.decision(0) == Seen("r", 20, 1)
    assert zero.decision(1) is None and one.decision(1) is None  # nothing newer: not passed again
    zero.publish(Seen("r", 20, 2))  # step 20 saved again (a timeline replayed): passed again, once both know
    one.publish(Seen("r", 20, 2))
    assert zero.decision(1) == Seen("r", 20, 2) and one.decision(1) == Seen("r", 20, 2)


def test_a_leader_with_no_agent_listening_goes_on_and_a_line_not_a_commit_is_not_acted_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "commits"
    os.mkfifo(fifo, 0o600)
    monkeypatch.setenv(agent_notice.FIFO_ENV, str(fifo))
    told = agent_notice.Committed(
        run="r", step=3, directory="/d/r/step-3", disk="d1", host="h1", catalog="pg://u:pw@h/c"
    )
    assert agent_notice.agent() is agent_notice.Agent.STARTING
    agent_notice.tell(told)  # nobody reading: nothing told, nothing raised, nothing blocked
    inbox = agent_notice.Inbox(fifo)
    try:
        assert agent_notice.agent() is agent_notice.Agent.LISTENING
        with open(fifo, "wb") as hostile:
            hostile.write(b'{"run": "r", "step": "x"}\nnot json\n{"run": ["r"], "step": 1, "directory": "/d",'
                          b' "disk": "d", "host": "h"}\n{"run": "r", "step": true, "directory": "/d", "disk": "d",'
                          b' "host": "h"}\n' + b"[" * 3000 + b"\n")  # fmt: skip
        assert inbox.take(5.0) == []  # nested too deep for the parser: refused, the agent goes on
        with open(fifo, "wb") as hostile:
            hostile.write(b"x" * (3 * agent_notice.MAX_LINE))  # a line never ended: not kept growing
        assert inbox.take(5.0) == [] and len(inbox._pending) <= agent_notice.MAX_LINE
        agent_notice.tell(told)
        got = inbox.take(5.0)
        assert got[-1:] == [told], got
    finally:
        inbox.close()
    assert "pw" not in repr(told) and told.shareable().catalog is None  # never shown, never sent on
    agent_notice.record_passed(fifo, {"r": "id-1", "other": "id-9"})
    assert agent_notice.passed("r") == "id-1" and agent_notice.passed("nothing") is None
    fifo.unlink()  # the agent ended and took its FIFO along: gone, not starting (nobody waits for it)
    assert agent_notice.agent() is agent_notice.Agent.GONE


def test_an_agent_killed_outright_leaves_nothing_behind_once_a_later_one_starts(tmp_path: Path) -> None:
    """An agent killed with SIGKILL cannot remove its directory (its FIFO, its ``passed`` file); the next
    agent started on the host removes those of ended jobs, and only those: a running job's, another host's
    (a temporary directory shared between hosts), another pid namespace's and a name not an agent's stay."""
    space = pids.space()
    assert space is not None
    boot, _, ns = space.partition(".")
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True).stdout.strip()  # fmt: skip
    stale = tmp_path / f"rewind-agent-{space}-{ended}-x1"
    running = tmp_path / f"rewind-agent-{space}-{os.getpid()}-x2"
    other_host = tmp_path / f"rewind-agent-{'0' * len(boot)}.{ns}-{ended}-x3"
    other_space = tmp_path / f"rewind-agent-{boot}.{int(ns) + 1}-{ended}-x4"
    not_agents = tmp_path / f"rewind-agent-{space}-{ended}"  # no random part: not an agent's name
    for d in (stale, running, other_host, other_space, not_agents):
        d.mkdir()
        os.mkfifo(d / "commits", 0o600)
    job = [sys.executable, "-c", "import os; print(os.environ['REWIND_HOST_AGENT'])"]
    env = {**os.environ, "TMPDIR": str(tmp_path), "REWIND_MEMORY_RING": "off"}  # the agent ends at once
    done = subprocess.run(host_agent.command(1, 2, f"127.0.0.1:{free_port()}", "s", job), env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    own = Path(done.stdout.strip()).parent
    assert own.name.startswith(f"rewind-agent-{space}-")
    assert not stale.exists()
    assert all(d.exists() for d in (running, other_host, other_space, not_agents))
    wait_until(lambda: not own.exists(), 30, "the agent removed its own directory as it ended", interval=0.05)


def _forwarded(port: int, to: int, stop: threading.Event) -> None:
    """Connections to 127.0.0.1:``port`` carried to ``to`` both ways, on threads, until ``stop`` (then every
    socket is closed)."""
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(0.2)
    opened: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    near = listener.accept()[0]
                    opened.append(near)
                    with contextlib.suppress(OSError):
                        opened.append(far := socket.create_connection(("127.0.0.1", to), timeout=10))
                        far.settimeout(None)
                        for a, b in ((near, far), (far, near)):
                            threading.Thread(target=pump, args=(a, b), daemon=True).start()
        finally:
            for s in (listener, *opened):
                s.close()

    threading.Thread(target=serve, daemon=True, name="store-forward").start()


def _listening(pid: int, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the agent of the node whose task (now its torchrun) is ``pid`` listens on its FIFO."""
    fifos = list(Path(tempfile.gettempdir()).glob(f"rewind-agent-{pids.space()}-{pid}-*/commits"))
    if len(fifos) != 1:
        return False
    monkeypatch.setenv(agent_notice.FIFO_ENV, str(fifos[0]))
    return agent_notice.agent() is agent_notice.Agent.LISTENING


@pytest.mark.timeout(420)
def test_agents_that_meet_after_the_ranks_started_take_the_passes_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host b's agent cannot reach node 0's store at first: the ranks start passing the ring themselves (step
    1, its pass held). Once b's agent reaches the store and both agents listen, the ranks hand the passes to
    them at the next save: the agents pass step 2 and record its ring copies."""
    work, release = tmp_path, tmp_path / "release"
    store, late = free_port(), free_port()
    _marked(work)
    held = {"REWIND_FAULT": "hold:ring.pass@1", "REWIND_FAULT_RELEASE": str(release)}
    stop = threading.Event()
    nodes = _hosts_under_agents(work, (f"127.0.0.1:{store}", f"127.0.0.1:{late}"), held, join_s=600)
    try:
        try:
            wait_until(
                lambda: Path(f"{release}.held").exists(), 120, "the ranks passing step 1", interval=0.05
            )
            assert not any(_listening(p.pid, monkeypatch) for p in nodes)
            _forwarded(late, store, stop)
            wait_until(lambda: all(_listening(p.pid, monkeypatch) for p in nodes), 60, "both agents listening",
                       interval=0.05)  # fmt: skip
        finally:
            release.touch()
        outs = _ended(nodes, 150)  # kills every node's processes if they have not ended by then
    finally:
        stop.set()
        for p in nodes:  # a wait that failed leaves none of the launch behind
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=30)
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outs)
    assert "the hosts' memory agents pass the peer ring from step 2 on" in outs[0]
    for node, out in enumerate(outs):
        assert f"memory agent (node {node}): {RUN} step 2 passed" in out, out[-3000:]
    assert _ring_rows(work) == {("host-a", "ring:host-b", "verified"), ("host-b", "ring:host-a", "verified")}
