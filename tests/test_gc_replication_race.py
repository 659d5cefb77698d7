"""Garbage collection and replication at once, on one key of a tier: a copy registered verified keeps its
bytes.

A step saved again supersedes the step's checkpoint, whose copy on the shared tier lies at the step's key.
Garbage collection reclaims that copy (its manifest deleted, then the key listed and each file deleted)
while a replication of the new checkpoint runs (`rewind gc` beside the `replicate-offsite` deployment):
the replication found the key free (no manifest), sent the new checkpoint there, kept the old files that
matched, and registered it verified; the reclaim then deleted what it had listed. The new checkpoint's
only off-site copy was verified in the catalog and missing files on the tier. Both run for real here (the
catalog on SQLite and on Postgres); the replication is started from inside the reclaim's listing of the
key, the moment the race needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rewind.infra import retention
from rewind.infra.catalog import copies, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint import share_push
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.format import keyring as kr
from rewind.infra.format import store
from rewind.infra.format.verify import Verdict
from rewind.infra.replication import replicate
from rewind.infra.restore import execute, plan
from rewind.infra.tiers.base import ObjectInfo
from rewind.infra.tiers.filesystem import FileTier
from rewind.infra.tiers.transfer import check_remote


@pytest.fixture(params=["sqlite", "postgres"])
def cat(request, rewind_env, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        monkeypatch.setenv("REWIND_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    return Catalog()


def _row(cat: Catalog, checkpoint_id: int) -> Checkpoint:
    return lineage.get_checkpoint(cat, checkpoint_id)


def _step_saved_again(
    cat: Catalog, run: str, tmp_path: Path
) -> tuple[Path, FileTier, Checkpoint, dict[str, torch.Tensor]]:
    """Step 5 saved and replicated to a shared tier at the step's key, then saved again (the first checkpoint
    superseded, its copy left to reclaim): the checkpoint root, the tier, the new checkpoint's row, its state."""
    root, shared = tmp_path / "ckpt", tmp_path / "shared"
    shared.mkdir()
    tier = FileTier(str(shared))
    model = torch.nn.Linear(128, 128)
    ck = Checkpointer(run, states={"model": model}, root=root, catalog=cat)
    ck.save(5)
    assert ck.last_saved is not None
    old = _row(cat, ck.last_saved.checkpoint_id)
    assert replicate(cat, old, tier).key == f"{run}/step-5"
    with torch.no_grad():
        model.weight.add_(1.0)
    ck.save(5)
    assert ck.last_saved is not None
    new = _row(cat, ck.last_saved.checkpoint_id)
    wanted = {k: v.clone() for k, v in model.state_dict().items()}
    ck.close()
    return root, tier, new, wanted


def test_a_copy_replicated_while_gc_reclaims_its_key_keeps_its_bytes(cat, run_name, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    root, tier, new, wanted = _step_saved_again(cat, run_name, tmp_path)

    listing = FileTier.list
    raced: list[str] = []

    def listed_while_replicating(self: FileTier, prefix: str) -> Iterator[ObjectInfo]:
        if prefix == f"{run_name}/step-5/" and not raced:  # the reclaim, its manifest already deleted
            raced.append(replicate(cat, new, tier).key)
        return listing(self, prefix)

    monkeypatch.setattr(FileTier, "list", listed_while_replicating)
    policy = retention.Policy(grace_s=0)
    retention.execute(cat, retention.plan(cat, run_name, policy, root=root), policy)
    monkeypatch.undo()
    assert raced, "the reclaim never listed the superseded copy's key"

    _kept_on_the_tier(cat, run_name, root, tier, new, wanted)


def test_a_share_pushed_while_gc_reclaims_its_key_keeps_its_bytes(cat, run_name, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The same race for a host's share sent after a commit on hosts' own disks (``share_push``): rank 0 asks
    the catalog whether the step's own key is another checkpoint's copy, and every host then sends its share
    to the step's other key (before, each host saw only that the key held no manifest)."""
    root, tier, new, wanted = _step_saved_again(cat, run_name, tmp_path)

    listing = FileTier.list
    raced: list[str] = []

    def listed_while_pushing(self: FileTier, prefix: str) -> Iterator[ObjectInfo]:
        if prefix == f"{run_name}/step-5/" and not raced:  # the reclaim, its manifest already deleted
            avoid = share_push.step_key_taken(cat, new.id, run_name, 5, tier)
            share = share_push.Share(run_name, 5, store.step_dir(root / run_name, 5), "disk0", with_common=True,
                                     avoid_step_key=avoid)  # fmt: skip
            raced.append(share_push.push(share, tier, cat).key)
        return listing(self, prefix)

    monkeypatch.setattr(FileTier, "list", listed_while_pushing)
    policy = retention.Policy(grace_s=0)
    retention.execute(cat, retention.plan(cat, run_name, policy, root=root), policy)
    monkeypatch.undo()
    assert raced and raced[0] != f"{run_name}/step-5", raced
    _kept_on_the_tier(cat, run_name, root, tier, new, wanted)


def _kept_on_the_tier(
    cat: Catalog, run: str, root: Path, tier: FileTier, new: Checkpoint, wanted: dict[str, torch.Tensor]
) -> None:
    """The new checkpoint's one copy on the tier is registered verified, every byte there, and restores from
    the tier alone, bit-exact."""
    on_tier = [r for r in copies.copies_of(cat, [new.id])[new.id] if r.tier == tier.name]
    assert [r.status for r in on_tier] == [R.VERIFIED.value]
    report = check_remote(
        tier, str(on_tier[0].key), str(new.manifest_digest), deep=True, keyring=kr.from_env()
    )
    assert report.verdict is Verdict.VERIFIED, [str(f) for f in report.findings]

    into = torch.nn.Linear(128, 128)  # restored from the tier alone, bit-exact
    loader = Checkpointer(run, states={"model": into}, root=root, catalog=cat)._load
    got = execute.execute(cat, plan.plan(cat, run, root=root, tiers=(tier.name,)), loader)
    assert got.step == 5 and got.source == tier.name
    assert all(torch.equal(into.state_dict()[k], v) for k, v in wanted.items())


def test_a_stale_gc_plan_leaves_a_key_another_gc_reclaimed_to_the_copy_sent_there_since(
    cat, run_name, tmp_path, monkeypatch
):  # type: ignore[no-untyped-def]
    """Two gcs planned the same reclaim (`rewind gc` and the scheduled retention); the first finished it and
    let the row go, the key is free, and the step's new checkpoint is sent there: the second, acting on its
    older plan, must leave that key alone (before, it deleted the manifest it found, listed the key and
    deleted the new copy's files while the copy was sent and registered verified)."""
    root, tier, new, _ = _step_saved_again(cat, run_name, tmp_path)
    policy = retention.Policy(grace_s=0)
    first, second = (retention.plan(cat, run_name, policy, root=root) for _ in range(2))
    retention.execute(cat, first, policy)

    listing = FileTier.list
    sent: list[str] = []

    def listed_while_replicating(self: FileTier, prefix: str) -> Iterator[ObjectInfo]:
        if prefix == f"{run_name}/step-5/" and not sent:  # the stale gc at the key, the new copy sent now
            sent.append(replicate(cat, new, tier).key)
        return listing(self, prefix)

    monkeypatch.setattr(FileTier, "list", listed_while_replicating)
    retention.execute(cat, second, policy)
    monkeypatch.undo()
    if not sent:  # the stale gc left the key alone: the new copy sent now
        sent.append(replicate(cat, new, tier).key)
    assert sent == [f"{run_name}/step-5"]  # the key was free: the first gc let the old copy go
    report = check_remote(tier, sent[0], str(new.manifest_digest), deep=True, keyring=kr.from_env())
    assert report.verdict is Verdict.VERIFIED, [str(f) for f in report.findings]
