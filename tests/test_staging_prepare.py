"""The staging memory of async saves made in the background before the first save, so that the first save
stalls for a copy alone: the memory is resident before the save, the save holds the values of the call (not
the prepared buffer's zeros), and a prepare that fails never fails the job. (A sharded save's shells
prepared the same way: tests/test_sharded_async.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.checkpoint.staging import StagingBuffer
from rewind.infra.training.session import TrainingSession

WIDTH = 1024  # 4 MiB a layer: the state (weights and AdamW's two moments) is about 50 MB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, WIDTH)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state_bytes(model: torch.nn.Module) -> int:
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_prepared_buffer_is_in_memory_before_the_first_save_which_holds_the_values_of_the_call(
    run_name: str, tmp_path: Path
) -> None:
    cat = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    model, opt = _job()
    ck = Checkpointer(run_name, states={"model": model, "optimizer": opt}, root=tmp_path / "ck", catalog=cat,
                      mode=SaveMode.ASYNC)  # fmt: skip
    before = _rss()
    ck.prepare()
    ck.wait()
    assert _rss() - before >= 0.9 * _state_bytes(model)  # resident now, not at the first save's copy
    assert lineage.checkpoints(cat, run_name) == []  # nothing saved by preparing
    held = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(1)
    with torch.no_grad():  # the moment save() returned: never in the checkpoint
        for p in model.parameters():
            p.add_(1.0)
    ck.close()
    again, opt2 = _job()
    ck2 = Checkpointer(
        run_name, states={"model": again, "optimizer": opt2}, root=tmp_path / "ck", catalog=cat
    )
    got = ck2.restore_latest()
    ck2.close()
    assert got is not None and got.step == 1
    assert all(torch.equal(v, held[k]) for k, v in again.state_dict().items())


def test_the_session_prepares_the_staging_memory_at_its_first_report(run_name: str, tmp_path: Path) -> None:
    model, opt = _job()
    cat = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    with TrainingSession(run_name, model=model, optimizer=opt, checkpoint_every=1000, mode=SaveMode.ASYNC,
                         root=tmp_path / "ck", catalog=cat) as session:  # fmt: skip
        before = _rss()
        session.report(1, 0.5)
        deadline = time.monotonic() + 60
        while _rss() - before < 0.9 * _state_bytes(model) and time.monotonic() < deadline:
            time.sleep(0.05)  # polled, bounded: the buffer is made in the background
        assert _rss() - before >= 0.9 * _state_bytes(model)
        _step(model, opt)
        session.save(2)
    assert [c.step for c in lineage.checkpoints(cat, run_name)] == [2]


def test_a_prepare_that_fails_leaves_the_buffer_to_the_first_save(
    run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(self: StagingBuffer, parts: object) -> None:
        raise MemoryError("no memory for the staging buffer now")

    monkeypatch.setattr(StagingBuffer, "prepare", no_memory)
    cat = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    model, opt = _job()
    ck = Checkpointer(run_name, states={"model": model, "optimizer": opt}, root=tmp_path / "ck", catalog=cat,
                      mode=SaveMode.ASYNC)  # fmt: skip
    ck.prepare()
    ck.save(1)  # neither raises the prepare's failure nor goes without a buffer
    ck.close()
    assert [(c.step, c.status) for c in lineage.checkpoints(cat, run_name)] == [(1, "committed")]
