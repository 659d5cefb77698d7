"""Hashing in the stall (``REWIND_HASH_IN_STALL``): an async save that hashes its staged files while the job
waits writes the same files as one that hashes them in the background and as a sync save; values changed
after ``save()`` returned never reach the file; a stream that is not the one hashed is never committed as
proven; ``auto`` hashes in the stall only when the job's threads hold every core."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import stall_hash
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.errors import ConfigError
from rewind.infra.format import manifest as mf
from rewind.infra.format import store, verify


def _job(run: str, cat: Catalog, root: Path, mode: SaveMode):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(run, states={"model": model, "optimizer": opt}, root=root, catalog=cat, mode=mode)
    return model, opt, ck


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
    monkeypatch.setenv(stall_hash.ENV, "on")
    cat = Catalog()
    model, opt, ck = _job(run_name, cat, tmp_path / "ckpt", SaveMode.ASYNC)
    _step(model, opt)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # while the persist writes
    ck.wait()
    ck.close()
    model2, _, ck2 = _job(run_name, cat, tmp_path / "ckpt", SaveMode.SYNC)
    restored = ck2.restore_latest()
    ck2.close()
    assert restored is not None and restored.step == 1 and not restored.skipped  # every file proved itself
    assert all(torch.equal(v, at_call[k]) for k, v in model2.state_dict().items())


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
    cores = len(os.sched_getaffinity(0))
    cpu = {"model": {"w": torch.zeros(4)}}
    monkeypatch.delenv(stall_hash.ENV, raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert stall_hash.wanted(cpu)
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


def test_a_setting_that_does_not_exist_is_refused_before_any_save(
    rewind_env, run_name, tmp_path, monkeypatch
):
    monkeypatch.setenv(stall_hash.ENV, "sometimes")
    with pytest.raises(ConfigError, match="REWIND_HASH_IN_STALL='sometimes': expected one of auto, on, off"):
        _job(run_name, Catalog(), tmp_path / "ckpt", SaveMode.ASYNC)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("step-*"))
