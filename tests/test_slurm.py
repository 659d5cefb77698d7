"""Real hosts under a real scheduler: a job of 2 hosts x 2 ranks under Slurm (hosts are network namespaces
with their own addresses, slurmd and disk, see tests/slurm_lab.py) loses a host; the scheduler's word makes
it one incident, and the job comes back on the host left and a spare, the lost host left out, no sample
skipped or repeated, its final weights those of an uninterrupted run. Checkpoints go to each host's own
disk (the same path, another disk on every host) and memory; each host passes its share to the next host's
memory (the peer ring) and sends it to the shared tier: the lost host's files come from the survivor's
memory (with no shared tier, from there alone) or the shared tier, the survivor's from its own disk, the
spare's from its peers. A crash that loses no host comes back on the same hosts and reads every byte
from their own disks and memory.

The ranks reach the catalog through the filesystem (SQLite): the lab's hosts share this machine's
filesystem (the catalog, the shared tier) but not its loopback, where Postgres listens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rewind.infra import joblog
from rewind.infra.catalog import incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.training.data import epoch_order
from tests import slurm_lab
from tests.prefect_support import wait_until
from tests.test_protect_any_job import BATCH, STEPS, config, protect
from tests.torchrun_support import torchrun

REPO = Path(__file__).resolve().parents[1]
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


@pytest.fixture(scope="module")
def lab() -> Iterator[slurm_lab.Lab]:
    why = slurm_lab.unavailable()
    if why:
        if os.environ.get("REWIND_REQUIRE_SLURM"):  # CI: these tests must run
            pytest.fail(why)
        pytest.skip(why)
    cluster = slurm_lab.Lab(hosts=3).up()
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def slurm_env(lab: slurm_lab.Lab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLURM_CONF", str(lab.conf))
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("REWIND_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("REWIND_CHECKPOINT_ROOT", str(lab.node_local / tmp_path.name))  # each host's own disk
    (tmp_path / "shared").mkdir()
    monkeypatch.setenv("REWIND_SHARED_URI", str(tmp_path / "shared"))
    monkeypatch.setenv("REWIND_MEMORY_ROOT", "/dev/shm/rewind-lab")  # each host's own memory: the peer ring
    monkeypatch.setenv(
        "REWIND_MEMORY_RING", "on"
    )  # sync saves: the pass inside each save (the default passes after it)
    lab.wait_idle()
    return tmp_path


def _local_run(home: Path, *, stop_at: int | None = None) -> Path:
    """The same job on 4 ranks on this machine, unsupervised; with ``stop_at``, stopped after that step's
    checkpoint and started again (it resumes from it): the restart the relaunch must equal, bit for bit."""
    env = {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": "",
           "REWIND_SHARED_URI": "", "OMP_NUM_THREADS": "1"}  # fmt: skip
    for steps in ([stop_at] if stop_at else []) + [STEPS]:
        cfg = config(home, "reference", steps=steps)
        done = subprocess.run([*torchrun(WORLD), "examples/any_job.py", str(cfg)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return home / "out" / "final.safetensors"


def _launch_at(run: str, step: int, launches: int) -> Any:
    """The run's launch number ``launches``, once every one of its ranks passed ``step``."""
    cat = Catalog()

    def probe() -> Any:
        try:
            ls = jobs.launches(cat, run)
        except Exception:  # the run is not in the catalog yet
            return None
        if len(ls) < launches:
            return None
        rows = jobs.progress(cat, ls[launches - 1].id)
        return ls[launches - 1] if len(rows) == WORLD and all((r.step or 0) >= step for r in rows) else None

    return wait_until(probe, 240, f"launch {launches}: all {WORLD} ranks past step {step}", interval=0.2)


def _samples_taken(log: Path, resumed: int, first_launch: int) -> list[int]:
    """Samples of the steps that count: the first launch's up to the restore point, all of the relaunch's
    (told apart by the launch each line names: a rank may die right after logging the restore step)."""
    taken: list[int] = []
    for f in log.glob("rank-*.log"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if int(r["launch"]) != first_launch or r["step"] <= resumed:
                taken += r["samples"]
    return taken


_RESTARTED: dict[int, Path] = {}  # restart step -> the local restart's final weights (computed once each)


def _restarted(tmp_path_factory: pytest.TempPathFactory, step: int) -> dict[str, torch.Tensor]:
    if step not in _RESTARTED:
        _RESTARTED[step] = _local_run(tmp_path_factory.mktemp(f"restart-{step}"), stop_at=step)
    return load_file(str(_RESTARTED[step]))


def _hurt(lab: slurm_lab.Lab, fault: str, hosts: list[str]) -> str:
    """Inflict ``fault`` on the launch placed on ``hosts``; the host it takes."""
    victim = hosts[0] if fault == "rendezvous-host-lost" else hosts[1]
    if fault == "network-isolation":
        lab.cut_link(victim)  # its ranks live on, cut off: a real partition
    else:
        lab.kill_host(victim)  # the machine is gone: slurmd, torchrun's agent, its ranks, its disk
        lab.wipe_disk(victim)
    return victim


def _heal(lab: slurm_lab.Lab, fault: str, victim: str) -> None:
    if fault == "network-isolation":
        lab.restore_link(victim)
        lab.wait_idle([victim])  # back to service; slurmd ends the orphaned step
    else:
        lab.revive_host(victim)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["host-lost", "rendezvous-host-lost", "network-isolation"])
def test_a_lost_host_comes_back_on_a_spare_host_without_losing_a_sample(
    fault: str,
    prefect_api: str,
    lab: slurm_lab.Lab,
    slurm_env: Path,
    run_name: str,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if fault != "host-lost" and not os.environ.get("REWIND_TEST_HOST_DRILLS"):
        pytest.skip(
            f"{fault} runs under `make test-host-drills` (with the drills; host-lost also in `make test-e2e`)"
        )
    from rewind.flows.training import recover_training, summary

    if fault == "host-lost":  # no shared tier: the lost host's share lives on in its peer's memory alone
        monkeypatch.delenv("REWIND_SHARED_URI")
    log = slurm_env / "samples"
    log.mkdir()
    cfg = config(slurm_env, run_name, sample_log=str(log), step_time_s=0.1)
    t, result = protect(run_name, cfg, nnodes=NODES, nproc_per_node=PER_NODE, launcher="slurm",
                        global_batch=WORLD * BATCH, lr=0.01, heartbeat_timeout_s=60)  # fmt: skip
    hosts = _launch_at(run_name, 12, 1).handoff["hosts"]
    assert len(set(hosts)) == NODES, hosts  # one node per host
    victim = _hurt(lab, fault, hosts)
    try:
        t.join(timeout=300)
        assert not t.is_alive() and result["status"] == "crash", result
        cat = Catalog()
        inc = incidents.get_incident(cat, result["incident_id"])
        assert inc.details["lost_hosts"] == [victim], inc.details
        assert inc.details["lost_node"] == hosts.index(victim), inc.details
        assert len(incidents.incidents_of(cat, run_name)) == 1  # one incident for one host
        # Both signals measured: a killed host's peers fail their collectives and exit within seconds, long
        # before the scheduler's node timeout; a cut-off host's peers hang, and the scheduler tells first.
        seen = inc.details["detection"]
        after = seen["seconds_after_last_progress"]
        print(f"detection of {fault}: {seen}")
        assert after["scheduler"] is not None and seen["first"] == (
            "scheduler" if fault == "network-isolation" else "exit"
        ), seen

        spare = next(h.name for h in lab.members if h.name not in hosts)
        recovered = summary(recover_training(result["incident_id"], return_state=True))
        assert recovered["status"] == "recovered", recovered
    finally:
        _heal(lab, fault, victim)
    inc = incidents.get_incident(cat, result["incident_id"])
    relaunch = jobs.launches(cat, run_name)[-1]
    survivor = next(h for h in hosts if h != victim)
    assert relaunch.handoff["hosts"] == [survivor, spare], relaunch.handoff  # the rendezvous on a survivor
    assert (inc.layout_before["dp"], inc.layout_after["dp"]) == (WORLD, WORLD), inc.decision
    assert f"leaving out lost host(s) {victim} for a spare" in inc.decision, inc.decision

    resumed = inc.details["resumed_at_step"]
    assert resumed in (10, 20, 30)
    order = epoch_order(4096, 0, 0).tolist()
    first = int(inc.details["launch_id"])
    assert sorted(_samples_taken(log, resumed, first)) == sorted(order[: STEPS * WORLD * BATCH]), (
        "a sample was skipped or repeated across the host loss"
    )
    # Bit for bit what a restart from the same step on one machine computes. (An unbroken run differs in
    # the last bits: with more than two gloo ranks a restarted DDP job sums its first gradients in
    # another order, Rewind or not; measured here: 6e-8 at most.)
    final = load_file(str(slurm_env / "out" / "final.safetensors"))
    restarted = _restarted(tmp_path_factory, resumed)
    assert final.keys() == restarted.keys() and all(torch.equal(final[k], restarted[k]) for k in final)
    # Where the restore point's bytes came from: the survivor's share from its own disk, the lost host's
    # from the survivor's memory (the peer ring) or the shared tier (each host sent its own), the spare's
    # from its peers. Without a shared tier (host-lost), the survivor's memory alone.
    read = inc.details["restore_read_from"]
    total = lineage.get_checkpoint(cat, inc.restored_checkpoint_id).total_bytes
    by_host = {h["host"]: h for h in read["hosts"]}
    assert set(by_host) == {survivor, spare}, read
    kept = by_host[survivor]
    lost_share = total - kept["local"]
    assert 0 < kept["local"] < total and kept["memory"] + kept["remote"] == lost_share, read
    assert by_host[spare]["local"] == 0 and by_host[spare]["peer"] == total, read
    assert read["bytes"].get("shared", 0) == kept["remote"], read
    if fault == "host-lost":
        assert kept["memory"] == lost_share, read
    _only_the_relaunch_committed(cat, run_name, resumed, inc.restored_checkpoint_id)


def _only_the_relaunch_committed(cat: Catalog, run: str, resumed: int, restored_id: int) -> None:
    """Every live checkpoint past the restore point descends from it: nothing the first launch left running
    (a cut-off host's ranks) committed one."""
    live = {c.id: c for c in lineage.checkpoints(cat, run) if c.status in ("committed", "verified")}
    for c in live.values():
        if c.step <= resumed:
            continue
        up = c
        while up.parent_id is not None and up.id != restored_id and up.parent_id in live:
            up = live[up.parent_id]
        assert up.id == restored_id, (
            f"step {c.step} (checkpoint {c.id}) does not descend from the restore point"
        )


@pytest.mark.timeout(600)
def test_a_crash_without_a_lost_host_comes_back_on_the_same_hosts_reading_only_their_disks(
    prefect_api: str, lab: slurm_lab.Lab, slurm_env: Path, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ring at its default setting: each host's memory agent (the task ``srun`` starts, the torchrun
    agent under it) passes the ring, not the ranks."""
    from rewind.flows.training import recover_training, summary

    monkeypatch.delenv("REWIND_MEMORY_RING")
    cfg = config(slurm_env, run_name, step_time_s=0.1)
    t, result = protect(run_name, cfg, nnodes=NODES, nproc_per_node=PER_NODE, launcher="slurm",
                        global_batch=WORLD * BATCH, lr=0.01, heartbeat_timeout_s=60)  # fmt: skip
    launch = _launch_at(run_name, 12, 1)
    hosts = launch.handoff["hosts"]
    cat = Catalog()
    wait_until(lambda: _agents_passed(run_name) == {0, 1} and _ring_held(cat, run_name) == set(hosts), 120,
               "the hosts' agents passing a checkpoint, recorded")  # fmt: skip
    victim = next(r for r in jobs.progress(cat, launch.id) if r.rank == WORLD - 1)  # a rank on host 2
    os.kill(
        victim.pid, signal.SIGKILL
    )  # the process, not the host: the hosts' namespaces share this machine's pids
    t.join(timeout=300)
    assert not t.is_alive() and result["status"] == "crash", result
    inc = incidents.get_incident(cat, result["incident_id"])
    assert not inc.details.get("lost_hosts"), inc.details

    recovered = summary(recover_training(result["incident_id"], shrink_on_crash=False, return_state=True))
    assert recovered["status"] == "recovered", recovered
    inc = incidents.get_incident(cat, result["incident_id"])
    assert jobs.launches(cat, run_name)[-1].handoff["hosts"] == hosts  # the same hosts, in the same order
    read = inc.details["restore_read_from"]
    total = lineage.get_checkpoint(cat, inc.restored_checkpoint_id).total_bytes
    assert [h["host"] for h in read["hosts"]] == hosts, read
    for h in read["hosts"]:  # each host's disk: its own share in place, the other host's from the host's
        # own memory (the peer ring) or, if the crash came before the ring passed this checkpoint, from it
        assert h["local"] > 0 and h["local"] + h["memory"] + h["peer"] == total and h["remote"] == 0, read
    assert not read["bytes"].get("shared"), read  # not one byte from the shared tier


def _agents_passed(run: str) -> set[int]:
    """The nodes of the run's first launch whose memory agent said it passed a checkpoint (not the ranks)."""
    (first, *_) = joblog.kept(run) or [None]
    if first is None:
        return set()
    return {node for node, path in first.nodes()
            if any(f"memory agent (node {node}): " in line and line.endswith(" received")
                   for line in joblog.lines(path))}  # fmt: skip


def _ring_held(cat: Catalog, run: str) -> set[str]:
    """The hosts whose memory holds a ring copy (verified) of one of the run's checkpoints."""
    return {r.host or "" for c in lineage.checkpoints(cat, run) for r in lineage.replicas_of(cat, c.id)
            if r.tier == "memory" and (r.key or "").startswith("ring:") and r.status == "verified"}  # fmt: skip


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", ["host-loss", "network-isolation"])
def test_a_host_drill_runs_on_the_cluster_and_times_each_phase(
    scenario: str, prefect_api: str, lab: slurm_lab.Lab, slurm_env: Path
) -> None:
    """`rewind drill run host-loss` / `network-isolation` against the lab: the fault is the scheduler's
    (a host taken down) or the host's own (its network cut from inside, healed after 45 s); the drill
    recovers the job on the host left and the spare, judges it, and records each phase, the topology
    rebuild time and which signal came first; every host is back in service afterwards."""
    if not os.environ.get("REWIND_TEST_HOST_DRILLS"):
        pytest.skip("the host drills run under `make test-host-drills` (about 4 minutes)")
    from rewind.flows.drills import run_one
    from rewind.infra.catalog import drills

    got = run_one(scenario)
    row = drills.get(Catalog(), got["id"])
    print(f"drill {scenario}: {got['outcome']} rto {got['rto_s']} phases {got['phases']} {row.details}")
    assert got["outcome"] == "passed", got
    assert row.details["topology_rebuild_s"] is not None and row.details["topology_rebuild_s"] > 0, (
        row.details
    )
    seen = row.details["detection"]
    assert seen["seconds_after_last_progress"]["scheduler"] is not None, seen
    if scenario == "network-isolation":  # the cut-off ranks' peers hang: no exit tells of it
        assert seen["first"] == "scheduler", seen
    assert all(p["s"] is not None for p in got["phases"].values()), got["phases"]
    lab.wait_idle()  # the rollback gave every host back
