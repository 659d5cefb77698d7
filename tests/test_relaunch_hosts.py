"""A relaunch on a scheduler asks first for the hosts whose own disks hold the restore point, never a lost
one, and the decision says so; the catalog names those hosts from the copies it recorded on their disks."""

from __future__ import annotations

import torch

from rewind.infra.catalog import copies, disks, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.format.local_tier import LocalTier
from rewind.infra.launch import rebuild
from rewind.infra.launch.spec import JobSpec

SPEC = JobSpec(command=("python", "train.py"), nnodes=2, nproc_per_node=2, launcher="slurm")


def _relaunch(previous: tuple[str, ...], lost: tuple[str, ...], holding: tuple[str, ...]) -> rebuild.Relaunch:
    hosts = rebuild.Hosts(previous=previous, lost=lost, usable=3, holding=holding)
    return rebuild.plan(SPEC, SPEC, "crash", lost_node=1 if lost else None, shrink=False, hosts=hosts)


def test_hosts_holding_the_restore_point_are_asked_for_first_and_a_lost_one_never() -> None:
    # h2 lost; h4 (a spare that came back with its disk) holds the restore point, h3 does not
    r = _relaunch(("h1", "h2"), ("h2",), ("h4", "h1", "h2"))
    assert r.handoff["prefer_hosts"] == ["h1", "h4"] and r.handoff["exclude_hosts"] == ["h2"]
    assert "preferring host(s) h1, h4, whose own disks hold the restore point" in r.decision
    # nobody holds it (every copy on a lost disk): the survivors in their order, as before
    assert _relaunch(("h1", "h2"), ("h2",), ()).handoff["prefer_hosts"] == ["h1"]


def test_a_host_holding_it_goes_first_so_the_rendezvous_and_rank_0_start_on_it() -> None:
    r = _relaunch(("h1", "h2"), (), ("h2",))
    assert r.handoff["prefer_hosts"] == ["h2", "h1"], r.handoff
    same = _relaunch(("h1", "h2"), (), ("h1", "h2"))  # both hold their share: the order is kept
    assert same.handoff["prefer_hosts"] == ["h1", "h2"] and "h1, h2" in same.decision


def test_the_catalog_names_the_hosts_whose_disks_hold_a_sound_copy(rewind_env, run_name, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cat = Catalog()
    Checkpointer(run_name, states={"model": torch.nn.Linear(4, 4)}, root=tmp_path / "ckpt", catalog=cat).save(
        10
    )
    (ck,) = lineage.checkpoints(cat, run_name, 10)
    for host, status in (
        ("h2", ReplicaStatus.VERIFIED),
        ("h3", ReplicaStatus.CORRUPT),
        ("h4", ReplicaStatus.PENDING),
    ):
        copies.add(cat, ck.id, "local", f"/nvme/{run_name}/step-10", key=None, nbytes=1, status=status,
                   disk=LocalTier(f"disk-{host}", host))  # fmt: skip
    copies.add(
        cat, ck.id, "shared", "/shared", key=f"{run_name}/step-10", nbytes=1, status=ReplicaStatus.VERIFIED
    )
    held = disks.hosts_holding(cat, ck.id)
    assert set(held) == {"h2", "h4"}, held  # a corrupt copy holds nothing; a disk seen here names no host
