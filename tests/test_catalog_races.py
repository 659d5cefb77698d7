"""The catalog under concurrent processes and SIGKILL: a read-check-write has one winner on SQLite as on
Postgres, and a first start killed while it creates the schema leaves a catalog the next start completes.

Each race is two real processes (:class:`Racers`) on one real catalog, a SQLite file or the session's
Postgres database, started once per backend for the module and kept up. Each round the test sets the rows
up, tells both what to do in the same instant (one line each on stdin), waits (bounded) for both answers
and checks the catalog and the bytes. Which side wins a round is up to the scheduler; that exactly one
does, and that the catalog and the bytes agree with what each side was told, is the test. Nothing waits by
sleeping: a racer blocks on its stdin, the test on its queue of answers. Which racer is told first, and in
half the rounds how much later one of them starts (up to ``JITTER_S``), come from a seed each test prints
and every failure names.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rewind.infra import retention
from rewind.infra.catalog import copies, incidents, leases, lineage, sessions
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, Incident, Replica
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import NotFoundError, Refused, RunBusy
from tests.prefect_support import wait_until

REPO = Path(__file__).resolve().parents[1]
ANSWER_S = 60.0  # the longest a round may take to answer (a round takes milliseconds)
JITTER_S = 0.003  # how much later one racer may start: about what one side's work takes
ROUNDS = 100  # per race and backend: a round takes milliseconds once the racers are up
REPLY_ROUNDS = 500  # a turn is cheaper, and the window it has to be caught in narrower


# -- what the racing processes do (each returns what it got, as JSON) ------------------------------------


def _take_writer(cat: Catalog, *, run: str) -> dict[str, Any]:
    try:
        leases.take_writer(cat, lineage.get_run(cat, run).id)
    except RunBusy:
        return {"busy": True}
    return {"writer": True}


def _gc(
    cat: Catalog, *, run: str, checkpoint_id: int, step: int, replica_id: int, uri: str, keep_last: int
) -> dict[str, Any]:
    """Retention deleting one checkpoint: its plan (a read made earlier) executed, guarded delete then bytes."""
    ref = retention.CopyRef(replica_id, copies.LOCAL, uri, None, R.VERIFIED.value)
    plan = retention.GcPlan(run, keep=[step + 1], remove=[retention.Removal(checkpoint_id, step, 1, [ref])])
    return {"removed": retention.execute(cat, plan, retention.Policy(keep_last=keep_last))}


def _lease(cat: Catalog, *, checkpoint_id: int) -> dict[str, Any]:
    """A restore taking its lease on the checkpoint it is about to read (``restore.execute.restoring``)."""
    try:
        return {"lease": leases.take(cat, checkpoint_id, "restore")}
    except NotFoundError as exc:
        return {"refused": str(exc)}


def _settle(cat: Catalog, *, checkpoint_id: int) -> dict[str, Any]:
    """A scrub that found the checkpoint's copy good settling its status (``copies.settle``)."""
    return {"status": copies.settle(cat, checkpoint_id)}


def _recover(cat: Catalog, *, incident_id: int, claimant: str) -> dict[str, Any]:
    from rewind.infra.phases import recovery  # Prefect's import: only the recovery racers pay for it

    found = recovery.begin(
        cat, incident_id=incident_id, claimant=claimant, max_incidents=1_000_000, window_s=3600.0
    )
    return {"held_by": found.held_by}


def _reply(
    cat: Catalog, *, key: str, prompt: list[int], reply: list[int], history_len: int, instance: str
) -> dict[str, Any]:
    """A serving instance recording its reply before returning it (``Conversations.turn``): the reply is
    acknowledged if, and only if, this returns a turn number."""
    try:
        n = sessions.record_turn(
            cat,
            key,
            "chat",
            prompt=prompt,
            reply=reply,
            blocks=[],
            history_len=history_len,
            instance=instance,
        )
    except Refused as exc:
        return {"refused": str(exc)}
    return {"turn": n}


ACTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "take_writer": _take_writer,
    "gc": _gc,
    "lease": _lease,
    "settle": _settle,
    "recover": _recover,
    "reply": _reply,
}


def serve() -> None:
    """One racing process on the catalog at ``sys.argv[1]``: each stdin line is one move (an action of
    ``ACTIONS`` and its arguments), each stdout line what it got. It exits at the end of its input."""
    cat = Catalog(sys.argv[1], auto_upgrade=False)
    with cat.session():
        pass  # connected before the first round, as the other racer is
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        move = json.loads(line)
        time.sleep(move["delay_s"])  # not a wait for anything: where in the other's work this one starts
        try:
            out = ACTIONS[move["do"]](cat, **move["args"])
        except Exception as exc:  # any other failure is a failure of the round, shown to the test
            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


class Racers:
    """Two racing processes on one catalog (``url``; checkpoint bytes under ``root``). :meth:`race` tells
    each its move at once and returns both answers; which is told first, and in half the rounds how much
    later one of them starts (up to ``JITTER_S``), come from ``seed``, so the rounds meet at different
    points of each other's work."""

    def __init__(self, url: str, home: Path) -> None:
        self.url, self.root = url, home / "ckpt"
        self.broken = False  # a racer stopped answering: the next test starts new ones
        self.seed, self.rng = 0, random.Random(0)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "REWIND_HOME": str(home),
            "REWIND_CHECKPOINT_ROOT": str(self.root),
        }
        env.pop("REWIND_FAULT", None)
        serve_ = "from tests.test_catalog_races import serve; serve()"
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", serve_, url],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        self.answers: list[queue.Queue[str | None]] = []
        for p in self.procs:
            q: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=self._read, args=(p, q), daemon=True).start()
            self.answers.append(q)
        ready = [self._answer(i) for i in range(2)]
        assert all("ready" in r for r in ready), f"the racers did not start: {ready}"

    def reseed(self) -> None:
        self.seed = random.randrange(2**32)
        self.rng = random.Random(self.seed)
        print(f"racers: seed {self.seed}")

    def at(self, round_: int) -> str:
        """Where a failure happened: the seed of the start times and the round."""
        return f"seed {self.seed}, round {round_}"

    @staticmethod
    def _read(p: subprocess.Popen[str], q: queue.Queue[str | None]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            q.put(line)
        q.put(None)

    def _answer(self, i: int) -> dict[str, Any]:
        try:
            line = self.answers[i].get(timeout=ANSWER_S)
        except queue.Empty:
            line = None
        if line is None:
            self.broken = True
            raise AssertionError(
                f"racer {i} gave no answer in {ANSWER_S:.0f}s (exit status {self.procs[i].poll()})"
            )
        got: dict[str, Any] = json.loads(line)
        return got

    def race(self, *moves: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """``(action, arguments)`` for each racer, told at once; what each got (both read before any is judged)."""
        order = [0, 1]
        self.rng.shuffle(order)
        delays = [0.0, 0.0]
        if self.rng.random() < 0.5:
            delays[order[1]] = self.rng.uniform(0.0, JITTER_S)
        lines = {
            i: json.dumps({"do": moves[i][0], "args": moves[i][1], "delay_s": delays[i]}) + "\n"
            for i in order
        }
        for i in order:
            stdin = self.procs[i].stdin
            assert stdin is not None
            stdin.write(lines[i])
            stdin.flush()
        got = [self._answer(i) for i in range(2)]
        for i, g in enumerate(got):
            assert "error" not in g, f"racer {i}, {moves[i][0]}: {g['error']}"
        return got

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()  # end of input: the racer exits
        for p in self.procs:
            try:
                p.wait(timeout=ANSWER_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=ANSWER_S)


@pytest.fixture(scope="module")
def racing(tmp_path_factory: pytest.TempPathFactory, pg_url: str) -> Iterator[Callable[[str], Racers]]:
    """``racing(backend)``: the two racers on that backend's catalog, started once for the module (a start
    costs more than a hundred rounds), reseeded for each test."""
    started: dict[str, Racers] = {}

    def on(backend: str) -> Racers:
        r = started.get(backend)
        if r is None or r.broken:
            if r is not None:
                r.close()
            home = tmp_path_factory.mktemp(f"racers-{backend}")
            url = f"sqlite:///{home / 'catalog.db'}" if backend == "sqlite" else pg_url
            Catalog(url).close()  # the schema, before the racers connect
            started[backend] = r = Racers(url, home)
        r.reseed()
        return r

    yield on
    for r in started.values():
        r.close()


def _checkpoint(
    cat: Catalog, root: Path, run: str, run_id: int, step: int, status: S, copy: R
) -> dict[str, Any]:
    """A checkpoint with one local copy whose bytes are really there (retention deletes them)."""
    where = root / run / f"step-{step}"
    where.mkdir(parents=True)
    (where / "data.bin").write_bytes(b"x" * 64)
    with cat.session() as s:
        ck = Checkpoint(run_id=run_id, step=step, path=str(where), status=status, total_bytes=64)
        s.add(ck)
        s.flush()
        rep = Replica(checkpoint_id=ck.id, tier=copies.LOCAL, uri=str(where), status=copy, bytes=64)
        s.add(rep)
        s.flush()
        return {"checkpoint_id": ck.id, "replica_id": rep.id, "uri": str(where)}


def _older_of_two(cat: Catalog, root: Path, run: str, status: S, copy: R) -> dict[str, Any]:
    """A run with step 1 (``status``, its copy ``copy``) and a verified step 2: retention's plan removes
    step 1; these are the arguments of its deletion."""
    run_id = lineage.ensure_run(cat, run)
    older = _checkpoint(cat, root, run, run_id, 1, status, copy)
    _checkpoint(cat, root, run, run_id, 2, S.VERIFIED, R.VERIFIED)
    return {"run": run, "step": 1, **older}


def _as_it_is(cat: Catalog, older: dict[str, Any]) -> tuple[S, bool]:
    """The checkpoint's status now, and whether its bytes are still there."""
    status = cat.get(Checkpoint, older["checkpoint_id"], "checkpoint").status
    return S(status), (Path(older["uri"]) / "data.bin").exists()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.timeout(240)
def test_two_processes_never_both_become_the_runs_writer(
    backend: str, racing: Callable[[str], Racers], run_name: str
) -> None:
    r = racing(backend)
    cat = Catalog(r.url)
    for round_ in range(ROUNDS):
        run = f"{run_name}-{round_}"  # a fresh run each round; both racers stay alive (never 'gone')
        lineage.ensure_run(cat, run)
        said = sorted(
            next(iter(got)) for got in r.race(("take_writer", {"run": run}), ("take_writer", {"run": run}))
        )
        assert said == ["busy", "writer"], f"{r.at(round_)}: {said}"


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.timeout(240)
def test_gc_never_deletes_a_checkpoint_a_restore_was_granted_a_lease_on(
    backend: str, racing: Callable[[str], Racers], run_name: str
) -> None:
    r = racing(backend)
    cat = Catalog(r.url)
    wins = {"restore": 0, "gc": 0}
    for round_ in range(ROUNDS):
        older = _older_of_two(cat, r.root, f"{run_name}-{round_}", S.VERIFIED, R.VERIFIED)
        gc, restore = r.race(
            ("gc", {**older, "keep_last": 1}), ("lease", {"checkpoint_id": older["checkpoint_id"]})
        )
        status, there = _as_it_is(cat, older)
        said = f"{r.at(round_)}: gc {gc}, restore {restore}; checkpoint {status}, bytes {'there' if there else 'gone'}"
        leased, removed = "lease" in restore, gc["removed"] == [1]
        assert gc["removed"] in ([], [1]) and leased != removed, said  # exactly one side wins
        if leased:
            assert status.value in leases.RESTORABLE and there, said
        else:
            assert status is S.DELETED and not there, said
        wins["restore" if leased else "gc"] += 1
    print(f"{backend}: rounds won {wins}")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.timeout(240)
def test_a_scrub_settling_a_checkpoint_never_brings_back_one_gc_deleted(
    backend: str, racing: Callable[[str], Racers], run_name: str
) -> None:
    """Retention deletes a committed step 1 (older than the newest verified); a scrub that has just found
    its copy good settles it to verified at the same time. keep_last=2 with one newer verified checkpoint:
    once verified it is kept, so exactly one side wins, and never 'verified' with its bytes deleted."""
    r = racing(backend)
    cat = Catalog(r.url)
    wins = {"settle": 0, "gc": 0}
    for round_ in range(ROUNDS):
        older = _older_of_two(cat, r.root, f"{run_name}-{round_}", S.COMMITTED, R.VERIFIED)
        gc, settle = r.race(
            ("gc", {**older, "keep_last": 2}), ("settle", {"checkpoint_id": older["checkpoint_id"]})
        )
        status, there = _as_it_is(cat, older)
        said = f"{r.at(round_)}: gc {gc}, settle {settle}; checkpoint {status}, bytes {'there' if there else 'gone'}"
        verified, removed = settle["status"] == S.VERIFIED.value, gc["removed"] == [1]
        assert gc["removed"] in ([], [1]) and verified != removed, said
        if removed:
            assert status is S.DELETED and not there and settle["status"] == S.DELETED.value, said
        else:
            assert status is S.VERIFIED and there, said
        wins["settle" if verified else "gc"] += 1
    print(f"{backend}: rounds won {wins}")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.timeout(240)
def test_two_recoveries_of_one_incident_never_both_act_on_it(
    backend: str, racing: Callable[[str], Racers], run_name: str
) -> None:
    r = racing(backend)
    cat = Catalog(r.url)
    lineage.ensure_run(cat, run_name)
    wins = {"a": 0, "b": 0}
    for round_ in range(ROUNDS):
        inc = incidents.open_incident(cat, run_name, "crash", "killed", details={"died_at": time.time()})
        names = [f"flow-{who}-{round_}" for who in "ab"]
        got = r.race(*(("recover", {"incident_id": inc, "claimant": n}) for n in names))
        row = cat.get(Incident, inc, "incident")
        said = (
            f"{r.at(round_)}: {dict(zip(names, got, strict=True))}; incident recovered by {row.recovered_by}"
        )
        acting = [n for n, g in zip(names, got, strict=True) if g["held_by"] is None]
        assert len(acting) == 1 and row.recovered_by == acting[0], said
        assert all(g["held_by"] in (None, acting[0]) for g in got), said  # the other was told who acts
        wins[acting[0].split("-")[1]] += 1
    print(f"{backend}: rounds won {wins}")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.timeout(240)
def test_two_replies_to_one_conversation_are_never_both_acknowledged(
    backend: str, racing: Callable[[str], Racers], run_name: str
) -> None:
    """Two instances answer the same turn of one conversation (the first round also creates it): one reply
    is recorded and acknowledged, the other refused; the history holds every acknowledged turn."""
    r = racing(backend)
    cat = Catalog(r.url)
    key, history, wins = f"s-{run_name}", list[int](), {"a": 0, "b": 0}
    for round_ in range(REPLY_ROUNDS):
        asks: list[dict[str, Any]] = [
            dict(key=key, prompt=[round_ % 256, i], reply=[200 + i], history_len=len(history), instance=who)
            for i, who in enumerate("ab")
        ]
        got = r.race(*(("reply", a) for a in asks))
        conv = sessions.load(cat, key)
        assert conv is not None
        said = f"{r.at(round_)}: {got}; the conversation has {conv.turns} turns, {len(conv.tokens)} tokens"
        acked = [a for a, g in zip(asks, got, strict=True) if "turn" in g]
        assert len(acked) == 1 and [g["turn"] for g in got if "turn" in g] == [round_ + 1], said
        won = acked[0]
        history += [*won["prompt"], *won["reply"]]
        assert (conv.turns, conv.tokens) == (round_ + 1, history), said
        assert sessions.recorded_turn(cat, key, round_ + 1) == (won["prompt"], won["reply"]), said
        wins[won["instance"]] += 1
    print(f"{backend}: rounds won {wins}")


@pytest.mark.timeout(240)
def test_a_first_start_killed_while_it_creates_the_catalog_leaves_one_the_next_start_completes(
    tmp_path: Path,
) -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    create = "import sys; from rewind.infra.catalog.db import Catalog; Catalog(sys.argv[1])"
    killed_mid = 0
    for i in range(12):
        db = tmp_path / f"c{i}" / "catalog.db"
        url = f"sqlite:///{db}"
        p = subprocess.Popen([sys.executable, "-c", create, url], cwd=REPO)
        wait_until(lambda db=db, p=p: db.exists() or p.poll() is not None, 60, "the file", interval=0.001)
        time.sleep(rng.uniform(0.0, 0.06))  # creating the schema takes ~60 ms here
        p.send_signal(signal.SIGKILL)
        killed_mid += p.wait(timeout=30) == -signal.SIGKILL
        cat = Catalog(url)  # the next start
        assert cat.current() == cat.head(), f"seed {seed}, round {i}"
        lineage.ensure_run(cat, "after")
        assert [r["run"] for r in lineage.list_runs(cat)] == ["after"]
        cat.close()
    assert killed_mid >= 6, f"seed {seed}: only {killed_mid} of 12 starts were killed before they finished"
