"""The chunked checkpoint format (issue 14, local tier): unchanged packs are hard-linked, not written.

A fine-tune with a frozen backbone and a small trainable head, on the real Postgres catalog:
later checkpoints write about the trainable bytes only, every checkpoint restores bit-exact,
deleting older ones leaves newer ones whole, a flipped byte in a pack is named (tensor and
chunk) and refused, and a SIGKILL in the middle of a chunked save loses nothing committed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rewind.flows.cli import main as rewind
from rewind.infra import retention
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.checkpoint.state import RNGState
from rewind.infra.errors import ConfigError, CorruptCheckpoint
from rewind.infra.format import chunked, packs, payload, store
from rewind.infra.format import manifest as mf
from tests.integrity_support import flip

REPO = Path(__file__).resolve().parent.parent
VOCAB, DIM = 4096, 256  # a 4 MiB frozen embedding: four 1 MiB chunks


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, 8)


def build(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    net.backbone.weight.requires_grad_(False)
    return net, torch.optim.AdamW(net.head.parameters(), lr=1e-2)


def train(net: Net, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (16, 12), generator=g)
    loss = net.head(net.backbone(ids).mean(dim=1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def checkpointer(run: str, root: Path, net: Net, opt: torch.optim.Optimizer, **kw: object) -> Checkpointer:
    states = {"model": net, "optimizer": opt, "rng": RNGState()}
    return Checkpointer(run, states=states, root=root, catalog=Catalog(), format="chunked", **kw)  # type: ignore[arg-type]


def trainable_bytes(net: Net, opt: torch.optim.Optimizer) -> int:
    weights = sum(p.numel() * p.element_size() for p in net.head.parameters())
    state = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return weights + state


def assert_restores(run: str, root: Path, net: Net, opt: torch.optim.Optimizer, step: int) -> None:
    """A fresh job (other seed) restores ``step`` and holds exactly ``net``'s and ``opt``'s state."""
    net2, opt2 = build(seed=99)
    ck = checkpointer(run, root, net2, opt2)
    try:
        got = ck.restore_latest()
    finally:
        ck.close()
    assert got is not None and got.step == step, ck.skipped
    for k, v in net.state_dict().items():
        assert torch.equal(v, net2.state_dict()[k]), k
    want, have = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert want.keys() == have.keys()
    for i in want:
        for k, v in want[i].items():
            assert torch.equal(v, have[i][k]), (i, k)


def save_steps(
    run: str, root: Path, steps: list[int], mode: SaveMode = SaveMode.SYNC
) -> tuple[Net, torch.optim.Optimizer, list]:  # type: ignore[type-arg]
    net, opt = build()
    ck = checkpointer(run, root, net, opt, mode=mode)
    results = []
    for step in steps:
        train(net, opt, step)
        ck.save(step)
        ck.wait()
        results.append(ck.last_saved)
    ck.close()
    return net, opt, results


@pytest.mark.parametrize("mode", [SaveMode.SYNC, SaveMode.ASYNC])
def test_frozen_backbone_writes_only_the_trainable_bytes(rewind_env, run_name, tmp_path, mode):
    root = tmp_path / "ckpt"
    net, opt, results = save_steps(run_name, root, [1, 2, 3, 4], mode)
    backbone = VOCAB * DIM * 4
    first, *later = results
    assert first.linked_bytes == 0 and first.written_bytes > backbone
    budget = trainable_bytes(net, opt) * 1.1 + 64 * 1024  # + index, state.json, RNG state and manifest
    for r in later:
        assert r.linked_bytes >= backbone, r
        assert r.written_bytes <= budget, (r.written_bytes, budget)
    # The backbone's pack is one inode shared by every step directory.
    pack_dir = root / run_name / "step-1" / packs.PACK_DIR
    shared = [p for p in pack_dir.iterdir() if p.stat().st_nlink == 4]
    assert sum(p.stat().st_size for p in shared) >= backbone
    assert_restores(run_name, root, net, opt, 4)
    for step in (1, 4):
        assert rewind(["ckpt", "verify", run_name, "--step", str(step), "--deep"]) == 0


def test_deleting_older_checkpoints_leaves_newer_ones_whole(rewind_env, run_name, tmp_path):
    root = tmp_path / "ckpt"
    net, opt, _ = save_steps(run_name, root, [1, 2, 3])
    shutil.rmtree(root / run_name / "step-1")  # behind Rewind's back: only links go
    policy = retention.Policy(keep_last=1)
    gc = retention.plan(Catalog(), run_name, policy)
    assert 2 in [r.step for r in gc.remove]
    retention.execute(Catalog(), gc, policy)
    assert not (root / run_name / "step-2").exists()
    assert rewind(["ckpt", "verify", run_name, "--step", "3", "--deep"]) == 0
    assert_restores(run_name, root, net, opt, 3)


def chunk_at(step_dir: Path, pack: str, offset: int) -> str:
    """The digest of the chunk that covers ``offset`` of ``pack``, from the checkpoint's index."""
    index = json.loads((step_dir / chunked.INDEX_FILE).read_bytes())
    name = pack.removeprefix(f"{packs.PACK_DIR}/")
    (digest,) = [d for d, o, n in index["packs"][name] if o <= offset < o + n]
    return str(digest)


def test_a_flipped_byte_in_a_pack_is_named_and_the_restore_falls_back(rewind_env, run_name, tmp_path):
    root = tmp_path / "ckpt"
    net, opt, _ = save_steps(run_name, root, [1])
    net1, opt1 = build()
    train(net1, opt1, 1)  # what step 1 holds
    ck = checkpointer(run_name, root, net, opt)
    assert ck.restore_latest().step == 1
    train(net, opt, 2)
    ck.save(2)
    ck.close()
    step2 = root / run_name / "step-2"
    index = mf.read(step2)  # the head's pack: only step 2 holds it
    head = next(
        e for e in index.files if e.path.startswith("packs/") and (step2 / e.path).stat().st_nlink == 1
    )
    flip(step2 / head.path)
    digest = chunk_at(step2, head.path, head.size // 2)
    net2, opt2 = build(seed=99)
    ck2 = checkpointer(run_name, root, net2, opt2)
    assert ck2.restore_latest().step == 1
    ck2.close()
    (skip,) = ck2.skipped
    assert skip.step == 2 and "\n" not in str(skip)
    (finding,) = skip.findings
    assert digest in finding.detail and "tensor '" in finding.detail and finding.path == head.path
    # Nothing of step 2 was applied: the job holds exactly step 1.
    for k, v in net1.state_dict().items():
        assert torch.equal(v, net2.state_dict()[k]), k
    assert_restores(run_name, root, net1, opt1, 1)


def test_a_damaged_pack_is_never_linked_into_a_later_save(rewind_env, run_name, tmp_path):
    """Bit rot in the frozen backbone's pack (mtime kept): the next save hashes the pack before linking
    it, finds it is not what the parent's manifest says, and writes the bytes it holds instead."""
    root = tmp_path / "ckpt"
    net, opt = build()
    ck = checkpointer(run_name, root, net, opt)
    try:
        train(net, opt, 1)
        ck.save(1)
        step1 = root / run_name / "step-1"
        backbone = max((e for e in mf.read(step1).files if e.path.startswith("packs/")), key=lambda e: e.size)
        st = (step1 / backbone.path).stat()
        flip(step1 / backbone.path)
        os.utime(step1 / backbone.path, ns=(st.st_atime_ns, st.st_mtime_ns))
        for step in (2, 3):
            train(net, opt, step)
            ck.save(step)
    finally:
        ck.close()
    for step in (2, 3):
        assert not (root / run_name / f"step-{step}" / backbone.path).samefile(step1 / backbone.path)
        assert rewind(["ckpt", "verify", run_name, "--step", str(step), "--deep"]) == 0, step
    assert rewind(["ckpt", "verify", run_name, "--step", "1", "--deep"]) == 1
    assert_restores(run_name, root, net, opt, 3)


_KILLED_JOB = """
import sys
from pathlib import Path
from tests.test_incremental import build, checkpointer, train
net, opt = build()
ck = checkpointer(sys.argv[1], Path(sys.argv[2]), net, opt)
for step in (1, 2):
    train(net, opt, step)
    ck.save(step)
ck.close()
"""


@pytest.mark.parametrize("point", ["save.file_written", "save.before_rename"])
def test_sigkill_during_a_chunked_save_leaves_the_previous_checkpoint(rewind_env, run_name, tmp_path, point):
    root = tmp_path / "ckpt"
    env = {**os.environ, "REWIND_FAULT": f"kill:{point}@2"}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_JOB, run_name, str(root)], cwd=REPO, env=env, timeout=120, check=False
    )
    assert proc.returncode == -9
    assert any(".tmp-" in p.name for p in (root / run_name).iterdir())
    net, opt = build()
    train(net, opt, 1)
    assert_restores(run_name, root, net, opt, 1)  # also sweeps the dead writer's temp directory
    assert not any(".tmp-" in p.name for p in (root / run_name).iterdir())
    # The run goes on in the same format, linking from what survived.
    net3, opt3 = build(seed=7)
    ck = checkpointer(run_name, root, net3, opt3)
    assert ck.restore_latest().step == 1
    train(net3, opt3, 2)
    ck.save(2)
    ck.close()
    assert ck.last_saved is not None and ck.last_saved.linked_bytes >= VOCAB * DIM * 4
    assert rewind(["ckpt", "verify", run_name, "--step", "2", "--deep"]) == 0


def test_a_chunked_checkpoint_replicates_and_restores_from_the_replica(rewind_env, run_name, tmp_path):
    root, shared = tmp_path / "ckpt", tmp_path / "shared"
    net, opt, _ = save_steps(run_name, root, [1, 2])
    assert rewind(["replicate", run_name, "--to", str(shared)]) == 0
    assert any((shared / run_name / "step-2" / packs.PACK_DIR).iterdir())
    assert rewind(["ckpt", "verify", run_name, "--step", "2", "--tier", "shared", "--deep"]) == 0
    shutil.rmtree(root / run_name / "step-2")  # the local copy is lost: the replica is fetched instead
    assert_restores(run_name, root, net, opt, 2)
    assert (root / run_name / "step-2" / chunked.INDEX_FILE).is_file()


def test_odd_tensors_round_trip_and_equal_chunks_are_stored_once(tmp_path):
    big = torch.arange(3 * 1024 * 300, dtype=torch.float32).reshape(3 * 1024, 300)  # 3.5 MiB: 4 chunks
    state = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "transposed": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "zeros_a": torch.zeros(64, 64),
        "zeros_b": torch.zeros(64, 64),
        "big": big,
        "note": "not a tensor",
    }
    trees, tensors = payload.split_states({"s": state})
    files = payload.file_writers(trees, tensors, fmt=payload.CHUNKED)
    draft = mf.Manifest(run="r", step=1, files=())
    done = store.write_checkpoint(tmp_path, draft, files)
    assert done.linked_bytes == 0
    pack_files = [e for e in done.manifest.files if e.path.startswith(f"{packs.PACK_DIR}/")]
    listed = json.loads((done.path / chunked.INDEX_FILE).read_bytes())["packs"]
    rows_per_chunk = chunked.CHUNK_BYTES // (300 * 4)
    big_chunks = -(-3 * 1024 // rows_per_chunk)
    # scalar, transposed, bf16, mask, one zeros chunk for both, the big tensor's chunks; none for "empty"
    assert len(pack_files) == 1 and sum(len(refs) for refs in listed.values()) == 5 + big_chunks
    got = payload.read_states(done.path, done.manifest)["s"]
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert (torch.equal(got[k], v) and got[k].dtype == v.dtype) if torch.is_tensor(v) else got[k] == v, k
    # The next step links every chunk it shares with this one.
    state["big"] = big.clone()
    state["big"][0, 0] = -1.0  # one row changed: one chunk rewritten
    trees, tensors = payload.split_states({"s": state})
    files = payload.file_writers(
        trees, tensors, fmt=payload.CHUNKED, link_from=chunked.Parent(done.path, done.digest)
    )
    done2 = store.write_checkpoint(tmp_path, mf.Manifest(run="r", step=2, files=()), files)
    first_chunk = rows_per_chunk * 300 * 4
    assert done2.written_bytes - done2.manifest_size <= first_chunk + 8192
    assert done2.linked_bytes >= 3 * 1024 * 300 * 4 - first_chunk
    assert torch.equal(payload.read_states(done2.path, done2.manifest)["s"]["big"], state["big"])


def test_the_plain_format_stays_the_default_and_links_nothing(rewind_env, run_name, tmp_path):
    net, opt = build()
    ck = Checkpointer(run_name, states={"model": net, "optimizer": opt}, root=tmp_path, catalog=Catalog())
    for step in (1, 2):
        train(net, opt, step)
        ck.save(step)
        saved = ck.last_saved
        assert saved is not None and saved.linked_bytes == 0 and saved.written_bytes > saved.total_bytes
    ck.close()
    assert sorted(p.name for p in (tmp_path / run_name / "step-2").iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]
    with pytest.raises(ConfigError, match="format"):
        Checkpointer(run_name, states={"model": net}, root=tmp_path, catalog=Catalog(), format="zip")


def test_the_flip_byte_drill_damages_a_chunk_only_the_newest_checkpoint_holds(rewind_env, run_name, tmp_path):
    from rewind.infra.drills.chaos import _damage

    root = tmp_path / "ckpt"
    _net, _opt, results = save_steps(run_name, root, [1, 2])
    newest = results[-1]
    said = _damage(Path(newest.path), 2, "flip_byte")
    target = Path(said.rsplit(": ", 1)[1])
    assert target.parent.name == packs.PACK_DIR and target.stat().st_nlink == 1
    net1, opt1 = build()
    train(net1, opt1, 1)
    assert_restores(run_name, root, net1, opt1, 1)


def test_an_index_that_does_not_tile_its_tensor_is_unloadable_not_corrupt(tmp_path):
    from rewind.infra.errors import UnloadableCheckpoint

    trees, tensors = payload.split_states({"s": {"w": torch.arange(6.0).reshape(3, 2)}})
    files = payload.file_writers(trees, tensors, fmt=payload.CHUNKED)
    index = json.loads(bytes(next(_capture(fill) for name, fill in files if name == chunked.INDEX_FILE)))
    index["states"]["s"]["s.w"]["chunks"][0][2] = 2  # claims rows 0..2 of 3
    bad = json.dumps(index).encode()
    files = [(n, (lambda out: out.write(bad)) if n == chunked.INDEX_FILE else f) for n, f in files]
    done = store.write_checkpoint(tmp_path, mf.Manifest(run="r", step=1, files=()), files)
    with pytest.raises(UnloadableCheckpoint, match=r"chunks\.json.*'s\.w'"):
        payload.read_states(done.path, done.manifest)


def _capture(fill: object) -> bytes:
    import io

    buf = io.BytesIO()
    fill(buf)  # type: ignore[operator]
    return buf.getvalue()


def _save(tmp_path: Path, step: int, state: dict, parent: store.Committed | None = None) -> store.Committed:  # type: ignore[type-arg]
    trees, tensors = payload.split_states({"s": state})
    link = chunked.Parent(parent.path, parent.digest) if parent is not None else None
    files = payload.file_writers(trees, tensors, fmt=payload.CHUNKED, link_from=link)
    return store.write_checkpoint(tmp_path, mf.Manifest(run="r", step=step, files=()), files)


def _loads(done: store.Committed, state: dict) -> None:  # type: ignore[type-arg]
    got = payload.read_states(done.path, done.manifest)["s"]
    assert all(torch.equal(got[k], v) for k, v in state.items()), done.path


def test_a_mostly_dead_pack_is_not_linked_its_live_chunks_move_to_a_stable_pack(tmp_path):
    """A pack under half used is not linked; its live chunks are carried apart from the changing ones,
    so from then on they sit in a pack that stays fully used and is linked, never written again."""
    stable = torch.arange(3 << 18, dtype=torch.float32).reshape(-1, 256)  # 3 MiB
    state = {"a": stable, "b": torch.randn(5 << 10, 256)}  # 5 MiB that changes every step
    one = _save(tmp_path, 1, state)
    assert len([e for e in one.manifest.files if e.path.startswith("packs/")]) == 1  # 8 MiB: one pack
    state["b"] = torch.randn(5 << 10, 256)
    two = _save(tmp_path, 2, state, one)
    assert two.linked_bytes == 0  # 3 of 8 MiB live: carried, not linked
    state["b"] = torch.randn(5 << 10, 256)
    three = _save(tmp_path, 3, state, two)
    assert three.linked_bytes == stable.numel() * 4  # the carried pack holds exactly "a"
    assert three.written_bytes - three.manifest_size <= (5 << 20) + 8192
    _loads(three, state)


def test_a_parent_pack_that_cannot_be_linked_is_written_from_memory(tmp_path):
    """A damaged parent (wrong size) is not linked: the new checkpoint is whole without it."""
    state = {"w": torch.randn(4 << 10, 256), "h": torch.randn(8, 256)}
    one = _save(tmp_path, 1, state)
    (pack,) = [e for e in one.manifest.files if e.path.startswith("packs/")]
    with open(one.path / pack.path, "ab") as f:
        f.write(b"junk")
    state["h"] = torch.randn(8, 256)
    two = _save(tmp_path, 2, state, one)
    assert two.linked_bytes == 0
    assert (two.path / pack.path).stat().st_ino != (one.path / pack.path).stat().st_ino
    verify_report = mf.read(two.path)
    from rewind.infra.format.verify import verify_files

    verify_files(two.path, verify_report)  # every file of the new checkpoint hashes to its entry
    _loads(two, state)


def test_a_parent_the_catalog_did_not_record_or_cannot_read_is_not_linked_and_the_save_goes_on(tmp_path):
    state = {"w": torch.randn(4 << 10, 256), "h": torch.randn(8, 256)}
    one = _save(tmp_path, 1, state)
    forged = store.Committed(one.path, one.manifest, "0" * 64)  # not the digest of its manifest
    assert _save(tmp_path, 2, state, forged).linked_bytes == 0
    # A parent whose (recorded) index cannot even be parsed: nothing linked, nothing raised.
    bad = b"[" * 100_000 + b"]" * 100_000
    trees, tensors = payload.split_states({"s": state})
    files = [
        (n, _writer(bad) if n == chunked.INDEX_FILE else f)
        for n, f in payload.file_writers(trees, tensors, fmt=payload.CHUNKED)
    ]
    hostile = store.write_checkpoint(tmp_path, mf.Manifest(run="r", step=3, files=()), files)
    four = _save(tmp_path, 4, state, hostile)
    assert four.linked_bytes == 0
    _loads(four, state)


def test_a_full_training_save_writes_few_large_packs(tmp_path):
    state = {f"layer{i}": torch.randn(1 << 10, 1 << 10) for i in range(20)}  # 80 MiB, all changing
    one = _save(tmp_path, 1, state)
    state = {k: v + 1 for k, v in state.items()}
    two = _save(tmp_path, 2, state, one)
    pack_files = [e for e in two.manifest.files if e.path.startswith("packs/")]
    assert two.linked_bytes == 0 and 3 <= len(pack_files) <= 4  # 80 MiB in packs of at most 32 MiB
    assert max(e.size for e in pack_files) <= packs.PACK_BYTES
    _loads(two, state)


def test_checkpoints_of_the_first_chunked_format_still_restore(tmp_path):
    """``rewind.chunks/1`` (one file per chunk) was written by an earlier release: it must stay readable."""
    state = {"w": torch.randn(3 << 10, 256), "b": torch.randn(3)}
    trees, tensors = payload.split_states({"s": state})
    index, chunks = chunked.build_index(tensors)
    index["format"] = chunked.LEGACY_FORMAT
    raw = json.dumps(index).encode()
    files = [(f"{chunked.LEGACY_CHUNK_DIR}/{d}", _writer(bytes(c.data))) for d, c in chunks.items()]
    files += [(chunked.INDEX_FILE, _writer(raw)), (payload.STATE_FILE, _writer(json.dumps(trees).encode()))]
    done = store.write_checkpoint(tmp_path, mf.Manifest(run="r", step=1, files=()), files)
    _loads(done, state)
    victim = next(e for e in done.manifest.files if e.path.startswith("chunks/"))
    flip(done.path / victim.path)
    with pytest.raises(CorruptCheckpoint, match=victim.path.removeprefix("chunks/")):
        payload.read_states(done.path, done.manifest)


def _writer(data: bytes):  # type: ignore[no-untyped-def]
    return lambda out: out.write(data)


def test_the_training_session_saves_in_the_chunked_format_when_asked(rewind_env, run_name, tmp_path):
    from rewind.infra.training.session import TrainingSession

    net, opt = build()
    with TrainingSession(
        run_name, model=net, optimizer=opt, checkpoint_every=2, format="chunked", root=tmp_path
    ) as s:
        for step in s.steps(4):
            train(net, opt, step)
            s.report(step)
    assert (tmp_path / run_name / "step-4" / packs.PACK_DIR).is_dir()
    net2, opt2 = build(seed=99)
    with TrainingSession(run_name, model=net2, optimizer=opt2, format="chunked", root=tmp_path) as s2:
        assert s2.start_step == 4
    for k, v in net.state_dict().items():
        assert torch.equal(v, net2.state_dict()[k]), k
    with pytest.raises(ConfigError, match="'zip' is not one of plain, chunked"):
        TrainingSession(run_name, model=net, format="zip", root=tmp_path)


class _Writes:
    """A file that keeps every write's bytes, one entry per call."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def write(self, data: memoryview) -> int:
        self.calls.append(bytes(data))
        return len(data)


def test_a_packs_chunks_cut_back_to_back_from_one_tensor_go_out_as_one_write():
    """A pack is its chunks' bytes in order; the chunks of one tensor lying back to back are written as one
    run (the disk takes one large write faster than 1 MiB ones), never merged across tensors or gaps."""
    rows = chunked.CHUNK_BYTES // (256 * 4)
    a = torch.arange(3 * rows * 256, dtype=torch.float32).reshape(3 * rows, 256)  # 3 chunks
    b = torch.ones(2 * rows, 256)  # 2 chunks, equal: stored once
    got: dict[str, packs.Chunk] = {}
    chunked.split_tensor("a", a, got)
    chunked.split_tensor("b", b, got)
    order = list(got.values())
    assert len(order) == 4
    pack = [order[0], order[2], order[1], order[3]]  # a gap in a's chunks: a0, then a2 alone, then a1 and b
    out = _Writes()
    packs.pack_writer(pack)(out)  # type: ignore[arg-type]
    assert b"".join(out.calls) == b"".join(bytes(c.data) for c in pack)
    assert len(out.calls) == 4  # nothing merged: a0 | a2 | a1 | b0
    out = _Writes()
    packs.pack_writer(order)(out)  # type: ignore[arg-type]
    assert b"".join(out.calls) == b"".join(bytes(c.data) for c in order)
    assert [len(c) for c in out.calls] == [3 * chunked.CHUNK_BYTES, chunked.CHUNK_BYTES]


def test_a_file_that_fails_fails_the_checkpoint_and_nothing_is_left_writing(tmp_path):
    """Files are written several at once: one failing fails the save, and only once every file started has
    ended, so no write lands in the temporary directory after it is removed."""
    started, ended = [], []

    def fill(i: int):  # type: ignore[no-untyped-def]
        def write(out) -> None:  # type: ignore[no-untyped-def]
            started.append(i)
            if i == 1:
                raise OSError(28, "No space left on device")
            out.write(bytes(4096 * (i + 1)))
            ended.append(i)

        return write

    files = [(f"f{i}.bin", fill(i)) for i in range(8)]
    with pytest.raises(OSError, match="No space left"):
        store.write_checkpoint(
            tmp_path, mf.Manifest(run="r", step=1, files=()), files, streams=store.WRITE_STREAMS
        )
    assert 1 in started and sorted(ended) == sorted(i for i in started if i != 1)
    assert not any(p.name.startswith("step-") for p in tmp_path.iterdir())
