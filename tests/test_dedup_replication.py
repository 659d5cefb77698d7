"""Deduplicated replication (issue 14, item 2): a tier copies what an earlier copy of the run already holds.

A frozen-backbone fine-tune saved in the chunked format, replicated to a real SeaweedFS and a real
shared-path tier, on the real Postgres catalog: the second checkpoint sends only the files that
changed (the rest is copied on the tier: CopyObject, hard links), every copy restores bit-exact
with the local tier gone, a tampered earlier copy is never copied into a verified one, and an
interrupted replication, resumed, sends nothing twice. Sizes are taken from the manifests, not
file names, so the tests hold whether the format stores chunks or packs.
"""

from __future__ import annotations

import base64
import filecmp
import json
import shutil
from pathlib import Path

import crc32c
import pytest
import torch

from rewind.flows.cli import main as rewind
from rewind.infra import progress
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.checkpoint.state import RNGState
from rewind.infra.format import keyring as kr
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_bytes
from rewind.infra.format.verify import Verdict
from rewind.infra.replication import Replicated, replicate
from rewind.infra.restore.foreign import verified_directory
from rewind.infra.tiers.base import AlreadyExists, NotCopied, ObjectNotFound, Tier
from rewind.infra.tiers.filesystem import FileTier
from rewind.infra.tiers.s3 import S3Tier
from rewind.infra.tiers.transfer import check_remote
from tests.integrity_support import flip
from tests.s3_support import BUCKET
from tests.test_incremental import DIM, VOCAB, Net, build, train


def _checkpointer(run: str, root: Path, net: Net, opt: torch.optim.Optimizer) -> Checkpointer:
    states = {"model": net, "optimizer": opt, "rng": RNGState()}
    return Checkpointer(run, states=states, root=root, catalog=Catalog(), format="chunked")


def _saved(run: str, root: Path, steps: int = 2) -> tuple[Net, list]:  # type: ignore[type-arg]
    """``steps`` chunked checkpoints of the fine-tune; the net as trained, and each checkpoint's catalog row."""
    net, opt = build()
    ck = _checkpointer(run, root, net, opt)
    rows = []
    for step in range(1, steps + 1):
        train(net, opt, step)
        ck.save(step)
        rows.append(lineage.get_checkpoint(Catalog(), ck.last_saved.checkpoint_id))
    ck.close()
    return net, rows


def _files(root: Path, run: str, step: int) -> dict[tuple[int, str, str], mf.FileEntry]:
    return {(e.size, e.xxh3, e.crc32c): e for e in mf.read(root / run / f"step-{step}").files}


def _changed_bytes(root: Path, run: str, step: int, on_tier: tuple[int, ...] = (1,)) -> int:
    """Bytes of the files of ``step`` that no copy on the tier (steps ``on_tier``) holds: what must be sent."""
    earlier = {k for s in on_tier for k in _files(root, run, s)}
    return sum(e.size for k, e in _files(root, run, step).items() if k not in earlier)


def _there(tier: Tier, key: str) -> bool:
    try:
        tier.stat(key)
    except ObjectNotFound:
        return False
    return True


def _open(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Tier:
    if kind == "shared":
        tier: Tier = FileTier(str(tmp_path / "shared"))
    else:
        request.getfixturevalue("s3_env")
        tier = S3Tier(f"s3://{BUCKET}/dedup-{tmp_path.name}", part_size=5 << 20, concurrency=2)
    tier.check()
    return tier


def _deep_clean(tier: Tier, ck: object, key: str) -> bool:
    report = check_remote(tier, key, str(ck.manifest_digest), deep=True, keyring=kr.from_env())  # type: ignore[attr-defined]
    return report.verdict is Verdict.VERIFIED


class Recorder:
    """A progress meter that keeps, per phase, the total announced and the bytes reported."""

    def __init__(self) -> None:
        self.phases: list[list] = []  # type: ignore[type-arg]
        self.open = False

    def begin(self, what: str, total: int) -> None:
        self.phases.append([what, total, 0])
        self.open = True

    def advance(self, nbytes: int) -> None:
        if self.open:  # bytes outside a phase (the manifest, written after it) belong to none
            self.phases[-1][2] += nbytes

    def end(self) -> None:
        self.open = False


def _crc(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


@pytest.mark.parametrize("kind", ["shared", "s3"])
def test_tier_copy_conformance(kind, tmp_path, request):
    """A copy on the tier: same bytes and checksum, never over an existing key, refused for other bytes."""
    tier = _open(kind, tmp_path, request)
    data = bytes(range(256)) * 4096
    tier.put_bytes("r/step-1/a", data, crc32c=_crc(data))
    tier.copy("r/step-1/a", "r/step-2/a", crc32c=_crc(data))
    info = tier.stat("r/step-2/a")
    assert info.size == len(data) and info.crc32c in (None, _crc(data))
    with tier.open("r/step-2/a") as f:
        assert f.read() == data
    with pytest.raises(AlreadyExists):
        tier.copy("r/step-1/a", "r/step-2/a", crc32c=_crc(data))
    with pytest.raises(ObjectNotFound):
        tier.copy("r/step-1/gone", "r/step-2/b", crc32c=_crc(data))
    with pytest.raises(NotCopied):  # the source is not the file asked for
        tier.copy("r/step-1/a", "r/step-2/c", crc32c=_crc(data + b"x"))
    assert sorted(o.key for o in tier.list("r/step-2/")) == ["r/step-2/a"]  # nothing left behind
    tier.delete("r/step-1/a")
    with tier.open("r/step-2/a") as f:  # the copy does not depend on its source
        assert f.read() == data


@pytest.mark.parametrize("kind", ["shared", "s3"])
def test_the_second_checkpoint_sends_only_what_changed(kind, rewind_env, run_name, tmp_path, request, capsys):
    root = tmp_path / "ckpt"
    tier = _open(kind, tmp_path, request)
    net, (first, second) = _saved(run_name, root)
    cat = Catalog()
    one = replicate(cat, first, tier)
    assert (one.bytes_sent, one.bytes_reused) == (first.total_bytes, 0)
    changed = _changed_bytes(root, run_name, 2)
    backbone = VOCAB * DIM * 4
    assert 0 < changed < backbone  # the fine-tune's premise: most bytes did not change
    capsys.readouterr()
    assert rewind(["replicate", run_name, "--to", tier.uri, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["step"] == 2 and row["bytes_sent"] == changed, row  # only the changed files went up
    assert row["bytes_reused"] == second.total_bytes - changed >= backbone, row
    assert _deep_clean(tier, second, row["key"])  # every byte of the copied files re-hashed: right
    if kind == "shared":  # a reused file is a hard link to the earlier copy's: one inode, no bytes written
        shared = Path(tier.uri) / run_name
        before, after = _files(root, run_name, 1), _files(root, run_name, 2)
        for k in before.keys() & after.keys():
            old, new = shared / "step-1" / before[k].path, shared / "step-2" / after[k].path
            assert old.stat().st_ino == new.stat().st_ino, after[k].path

    # Both copies restore bit-exact from the tier with the local tier gone.
    original = tmp_path / "original"
    shutil.copytree(root / run_name, original, symlinks=True)
    shutil.rmtree(root / run_name)
    for step in (1, 2):
        got = verified_directory(cat, run_name, step=step, root=root, tiers=(tier.name,))
        assert got.step == step and got.fetched
        for e in mf.read(got.directory).files:
            assert filecmp.cmp(got.directory / e.path, original / f"step-{step}" / e.path, shallow=False)
    net2, opt2 = build(seed=99)
    ck = _checkpointer(run_name, root, net2, opt2)
    try:
        restored = ck.restore_latest()
    finally:
        ck.close()
    assert restored is not None and restored.step == 2
    for k, v in net.state_dict().items():
        assert torch.equal(v, net2.state_dict()[k]), k


def _tamper(kind: str, tier: Tier, key: str, s3: object) -> None:
    """Change a file of an earlier copy behind Rewind's back: same size, other bytes."""
    if kind == "shared":
        flip(Path(tier.uri) / key)
        return
    client, full = s3.client(), f"{tier.uri.split('/', 3)[3]}/{key}"  # type: ignore[attr-defined]
    body = bytearray(client.get_object(Bucket=BUCKET, Key=full)["Body"].read())
    body[len(body) // 2] ^= 0x10
    client.delete_object(Bucket=BUCKET, Key=full)
    own = {"ChecksumCRC32C": hash_bytes(bytes(body)).crc32c} if kind == "s3-own-checksum" else {}
    client.put_object(Bucket=BUCKET, Key=full, Body=bytes(body), **own)


@pytest.mark.parametrize("kind", ["shared", "s3", "s3-own-checksum"])
def test_a_tampered_earlier_copy_is_sent_again_not_copied(kind, rewind_env, run_name, tmp_path, request):
    """A reused file's bytes are held to the new manifest: damage in the earlier copy never spreads."""
    root = tmp_path / "ckpt"
    tier = _open(kind.split("-")[0], tmp_path, request)
    _, (first, second) = _saved(run_name, root)
    cat = Catalog()
    replicate(cat, first, tier)
    shared = [e for k, e in _files(root, run_name, 1).items() if k in _files(root, run_name, 2)]
    victim = max(shared, key=lambda e: e.size)  # a file step 2 would copy rather than send
    _tamper(
        kind,
        tier,
        f"{run_name}/step-1/{victim.path}",
        request.getfixturevalue("s3") if "s3" in kind else None,
    )
    meter = Recorder()
    with progress.watching(meter):
        done = replicate(cat, second, tier)
    assert done.bytes_sent == _changed_bytes(root, run_name, 2) + victim.size  # the victim went up
    (send,) = [p for p in meter.phases if p[0].startswith("send ")]
    assert send[2] == send[1] > 0  # copied files are progress too, every file counted once
    assert done.bytes_reused == second.total_bytes - done.bytes_sent
    assert _deep_clean(tier, second, done.key)
    assert not _deep_clean(tier, first, f"{run_name}/step-1")  # the damage stays where it was


@pytest.mark.parametrize("kind", ["shared", "s3"])
def test_a_resumed_replication_sends_nothing_twice(kind, rewind_env, run_name, tmp_path, request):
    root = tmp_path / "ckpt"
    tier = _open(kind, tmp_path, request)
    _, rows = _saved(run_name, root, steps=3)
    cat = Catalog()
    replicate(cat, rows[0], tier)
    seen: list[tuple[str, int]] = []

    class Cut(Exception):
        pass

    def cut(path: str, sent: int) -> None:
        seen.append((path, sent))
        if sent > 0 and len(seen) >= 3:  # some files copied, at least one sent: then the process stops
            raise Cut(path)

    with pytest.raises(Cut):
        replicate(cat, rows[2], tier, on_file=cut)
    assert not [r for r in lineage.replicas_of(cat, rows[2].id) if r.tier == tier.name]
    assert tier.stat(f"{run_name}/step-3/{seen[0][0]}").size > 0  # files are there, no manifest
    with pytest.raises(ObjectNotFound):
        tier.stat(f"{run_name}/step-3/{mf.MANIFEST_NAME}")
    # Files in flight when the process stopped landed too: what the target holds is not sent again.
    earlier = set(_files(root, run_name, 1))
    changed = {e.path: e.size for k, e in _files(root, run_name, 3).items() if k not in earlier}
    landed = sum(n for path, n in changed.items() if _there(tier, f"{run_name}/step-3/{path}"))
    assert landed >= seen[-1][1] > 0
    done: Replicated = replicate(cat, rows[2], tier)
    assert done.bytes_sent == sum(changed.values()) - landed  # nothing sent twice, nothing missed
    assert done.bytes_sent + done.bytes_reused < rows[2].total_bytes  # what was there stayed
    assert _deep_clean(tier, rows[2], done.key)
