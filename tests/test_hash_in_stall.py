"""Hashing in the stall (``REWIND_HASH_IN_STALL``): an async save that hashes its staged files while the job
waits writes the same files as one that hashes them in the background and as a sync save, and its persist
records the stall's digests without hashing again; values changed after ``save()`` returned never reach
the file, a save right after another included; copied and hashed in one pass on any number of threads,
any layout stages and hashes exactly as the plain writer would; a stream that is not the one hashed is
never committed as proven; ``auto`` hashes in the stall only when the job's threads hold every core, a
cgroup's CPU quota counted."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch

from rewind.infra import cpus
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import stage_hashed, stall_hash
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.checkpoint.staging import StagingBuffer
from rewind.infra.errors import ConfigError
from rewind.infra.format import digest, payload, store, tensorfile, verify
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import FileDigest


def _job(run: str, cat: Catalog, root: Path, mode: SaveMode):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(run, states={"model": model, "optimizer": opt}, root=root, catalog=cat, mode=mode)
    return model, opt, ck


def _streamed(fill: store.FileWriter) -> bytes:
    """The bytes ``fill`` streams."""
    out = io.BytesIO()
    fill(out)
    return out.getvalue()


def _step(model, opt) -> None:  # type: ignore[no-untyped-def]
    model(torch.randn(16, 256)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _files(cat: Catalog, run: str) -> list[tuple[mf.FileEntry, ...]]:
    return [mf.read(Path(c.path)).files for c in lineage.checkpoints(cat, run)]


def test_hashed_in_the_stall_or_in_the_background_the_files_are_a_sync_saves(
    rewind_env, run_name, tmp_path, monkeypatch
):
    cat = Catalog()
    saved = {}
    for label, mode, setting in [("sync", SaveMode.SYNC, "off"), ("bg", SaveMode.ASYNC, "off"),
                                 ("stall", SaveMode.ASYNC, "on")]:  # fmt: skip
        monkeypatch.setenv(stall_hash.ENV, setting)
        model, opt, ck = _job(f"{run_name}-{label}", cat, tmp_path / "ckpt", mode)
        for step in (1, 2):
            _step(model, opt)
            ck.save(step)
        ck.close()
        saved[label] = _files(cat, f"{run_name}-{label}")
    assert len(saved["sync"]) == 2
    assert saved["stall"] == saved["bg"] == saved["sync"]  # path, size, xxh3 and crc32c of every file


def test_values_changed_after_save_returned_never_reach_the_file(rewind_env, run_name, tmp_path, monkeypatch):
    """The second save reuses the staging buffer at once, while the job keeps changing its tensors."""
    monkeypatch.setenv(stall_hash.ENV, "on")
    cat = Catalog()
    model, opt, ck = _job(run_name, cat, tmp_path / "ckpt", SaveMode.ASYNC)
    at_call = {}
    for step in (1, 2):
        _step(model, opt)
        at_call[step] = {k: v.clone() for k, v in model.state_dict().items()}
        ck.save(step)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7.0)  # while the persist writes
    ck.close()
    for c in lineage.checkpoints(cat, run_name):
        report = verify.check_copy(Path(c.path), c.manifest_digest, deep=True)
        assert report.findings == ()  # every byte is the one its manifest records
        entry = next(e for e in report.manifest.files if e.path == "model.safetensors")
        saved = payload.read_tensors(Path(c.path), entry)
        assert saved.keys() == {f"model.{k}" for k in at_call[c.step]}
        assert all(torch.equal(saved[f"model.{k}"], v) for k, v in at_call[c.step].items()), c.step


def test_the_persist_records_the_stalls_digests_without_hashing_again(
    rewind_env, run_name, tmp_path, monkeypatch
):
    """A stall digest made wrong on purpose reaches the manifest as it is (the persist did not hash the file
    again), and the restore refuses that checkpoint for the one before."""
    monkeypatch.setenv(stall_hash.ENV, "on")
    cat = Catalog()
    model, opt, ck = _job(run_name, cat, tmp_path / "ckpt", SaveMode.ASYNC)
    _step(model, opt)
    ck.save(1)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    ck.wait()
    real = stage_hashed.stage_and_hash
    wrong = "0" * 32

    def lying(*args, **kwargs):  # type: ignore[no-untyped-def]
        staged, files = real(*args, **kwargs)
        f = files["model.safetensors"]
        d = f.digest
        return staged, {
            **files,
            "model.safetensors": store.Hashed(f.fill, FileDigest(d.size, wrong, d.crc32c)),
        }

    monkeypatch.setattr(stage_hashed, "stage_and_hash", lying)
    _step(model, opt)
    ck.save(2)
    ck.close()
    newest = lineage.checkpoints(cat, run_name)[-1]
    assert newest.step == 2
    assert next(e for e in mf.read(Path(newest.path)).files if e.path == "model.safetensors").xxh3 == wrong
    model2, _, ck2 = _job(run_name, cat, tmp_path / "ckpt", SaveMode.SYNC)
    restored = ck2.restore_latest()
    ck2.close()
    assert restored is not None and restored.step == 1 and [s.step for s in restored.skipped] == [2]
    assert all(torch.equal(v, good[k]) for k, v in model2.state_dict().items())


def _layout(rnd: random.Random) -> dict[str, dict[str, torch.Tensor]]:
    """Parts of unequal sizes: tensors of several dtypes, empty ones, sizes about a block and not whole."""
    sizes = [
        0,
        1,
        3,
        1000,
        stage_hashed.BLOCK // 4 - 1,
        stage_hashed.BLOCK // 2 + 5,
        3 * stage_hashed.BLOCK + 7,
    ]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64]
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for p, count in (("big", 12), ("small", 3), ("one", 1)):
        tensors = {}
        for i in range(count):
            n, dtype = rnd.choice(sizes) // 8 + (i % 3), rnd.choice(dtypes)
            t = torch.randint(0, 2 if dtype is torch.bool else 100, (n,)).to(dtype)
            tensors[f"t{i}"] = t
        parts[p] = tensors
    parts["big"]["huge"] = torch.randn(5 * stage_hashed.BLOCK // 4 + 3)  # blocks for the helpers to take
    return parts


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_one_pass_stages_and_hashes_any_layout_as_the_plain_writer_would(workers):
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    for _ in range(3):
        parts = _layout(rnd)
        staging = StagingBuffer()
        staged, files = stage_hashed.stage_and_hash(staging, parts, workers=workers)
        for p, tensors in parts.items():
            assert all(torch.equal(staged.parts[p][k], t) for k, t in tensors.items()), (seed, p)
            want = store.hash_stream(
                lambda out, ts=tensors: tensorfile.write(out, ts)
            )  # from the job's tensors
            assert files[payload.tensor_file(p)].digest == want, (seed, p)
            # the file is written from the bytes hashed: the plain writer's bytes, exactly
            written = _streamed(files[payload.tensor_file(p)].fill)
            assert written == _streamed(lambda out, ts=tensors: tensorfile.write(out, ts)), (seed, p)


def test_a_later_pass_over_the_same_buffer_stages_and_hashes_tensors_from_where_they_are_now():
    """The block plan is kept while the job's tensors stay where they are: tensors of the same shapes made
    anew (other addresses, other bytes) are copied and hashed from where they are now; a part of empty
    tensors alone is its header."""
    seed = random.randrange(1 << 30)
    parts = _layout(random.Random(seed))
    parts["empty"] = {"a": torch.empty(0), "b": torch.empty(0, 3, dtype=torch.int64)}
    staging = StagingBuffer()
    for _ in range(2):
        stage_hashed.stage_and_hash(staging, parts, workers=2)
        parts = {p: {k: _flipped(t) for k, t in ts.items()} for p, ts in parts.items()}  # moved, changed
        staged, files = stage_hashed.stage_and_hash(staging, parts, workers=2)
        for p, tensors in parts.items():
            plain_bytes = _streamed(lambda out, ts=tensors: tensorfile.write(out, ts))
            assert _streamed(files[payload.tensor_file(p)].fill) == plain_bytes, (seed, p)
            assert files[payload.tensor_file(p)].digest == store.hash_stream(store.bytes_writer(plain_bytes))
            assert all(
                bytes(tensorfile.byte_view(staged.parts[p][k])) == bytes(tensorfile.byte_view(t))
                for k, t in tensors.items()
            ), (seed, p)


def _flipped(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` elsewhere in memory, the lowest bit of each of its bytes flipped (a bool stays one)."""
    out = t.clone()
    out.view(torch.uint8).bitwise_xor_(1)
    return out


def test_a_state_a_copy_of_bytes_does_not_stage_is_staged_and_hashed_all_the_same(monkeypatch):
    monkeypatch.setenv(stall_hash.ENV, "on")
    base = torch.randn(300, 400)
    parts = {
        "model": {"transposed": base.t(), "w": torch.randn(1000)},
        "optimizer": {"m": torch.randn(70_000)},
    }
    assert not stage_hashed.plain(parts)
    staged, files = stall_hash.stage_and_hash(StagingBuffer(), parts)
    for p, tensors in parts.items():
        assert all(torch.equal(staged.parts[p][k], t) for k, t in tensors.items())
        assert files[payload.tensor_file(p)].digest == store.hash_stream(
            lambda out, ts=tensors: tensorfile.write(out, ts)
        )
        assert _streamed(files[payload.tensor_file(p)].fill) == _streamed(
            lambda out, ts=tensors: tensorfile.write(out, ts)
        )


def test_a_stream_of_another_length_than_hashed_is_refused(tmp_path):
    hashed = store.hash_stream(store.bytes_writer(b"x" * 5000))
    with pytest.raises(RuntimeError, match="5001 bytes written, 5000 hashed"):
        store.write_file(tmp_path / "f", store.Hashed(store.bytes_writer(b"x" * 5001), hashed))


def test_a_stream_other_than_hashed_is_never_a_checkpoint_that_proves_itself(tmp_path):
    """Same length, other bytes: the manifest holds the hashed digest, and verification finds the file's
    bytes are not it."""
    draft = mf.Manifest(run="r", step=1, files=(), created_at="2026-12-06T00:00:00+00:00")
    hashed = store.hash_stream(store.bytes_writer(b"a" * 9000))
    done = store.write_checkpoint(
        tmp_path / "run", draft, [("part.bin", store.Hashed(store.bytes_writer(b"b" * 9000), hashed))]
    )
    assert done.manifest.files[0].xxh3 == hashed.xxh3
    report = verify.check_copy(done.path, done.digest, deep=True)
    assert [(f.problem, f.path) for f in report.findings] == [(verify.Problem.DIGEST, "part.bin")]


def test_auto_hashes_in_the_stall_only_when_the_job_holds_every_core(monkeypatch):
    cores = cpus.cores()
    cpu = {"model": {"w": torch.zeros(4)}}
    elsewhere = {"model": {"w": torch.zeros(4, device="meta")}}  # not on the CPU: the copy is not the job's
    monkeypatch.delenv(stall_hash.ENV, raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert stall_hash.wanted(cpu)
        assert not stall_hash.wanted(elsewhere)
        if cores > 1:
            torch.set_num_threads(cores - 1)  # a core left to the background persist
            assert not stall_hash.wanted(cpu)
        monkeypatch.setenv(stall_hash.ENV, "on")
        assert stall_hash.wanted(cpu)
        torch.set_num_threads(cores)
        monkeypatch.setenv(stall_hash.ENV, "off")
        assert not stall_hash.wanted(cpu)
    finally:
        torch.set_num_threads(threads)


def test_a_cgroup_cpu_quota_bounds_the_cores_counted(tmp_path, monkeypatch):
    """``cpu.max`` of this process's cgroup (v2) as a container runtime writes it: 1.5 CPUs count as 2."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    own = next((line[3:] for line in lines if line.startswith("0::")), None)
    if own is None:
        pytest.skip("this machine has no cgroup v2 entry for the process")
    where = tmp_path / own.lstrip("/")
    where.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(cpus, "CGROUP_ROOT", tmp_path)
    (where / "cpu.max").write_text("max 100000\n")
    unbounded = cpus.usable()
    (where / "cpu.max").write_text("150000 100000\n")
    assert cpus.usable() == min(unbounded, 2) and cpus.cores() <= 2
    (where / "cpu.max").write_text("50000 100000\n")
    assert cpus.usable() == cpus.cores() == 1


def test_a_setting_that_does_not_exist_is_refused_before_any_save(
    rewind_env, run_name, tmp_path, monkeypatch
):
    monkeypatch.setenv(stall_hash.ENV, "sometimes")
    with pytest.raises(ConfigError, match="REWIND_HASH_IN_STALL='sometimes': expected one of auto, on, off"):
        _job(run_name, Catalog(), tmp_path / "ckpt", SaveMode.ASYNC)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("step-*"))


def test_crc32c_combined_from_pieces_is_the_crc32c_of_the_whole():
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    for _ in range(100):
        a = rnd.randbytes(rnd.randint(0, 3000))
        b = rnd.randbytes(rnd.choice([0, 1, 7, 4096, stage_hashed.BLOCK, rnd.randint(0, 70_000)]))
        assert digest.crc32c_combine(digest.crc32c(a), digest.crc32c(b), len(b)) == digest.crc32c(a + b), seed


@pytest.mark.parametrize("cached", [0, -1])
def test_pieces_of_no_bytes_are_refused_not_left_unhashed(cached):
    with pytest.raises(ValueError, match="at least one byte"):
        digest.Hasher().update(b"abc", cached=cached)
