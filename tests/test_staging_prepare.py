"""The staging memory of async saves made in the background before the first save, so that the first save
stalls for a copy alone: the save then faults in none of its buffer's pages (it copies into the memory the
prepare made resident), holds the values of the call (not the prepared buffer's zeros), and a prepare that
fails, or one asked for while a save's failure is still to be raised, never fails the job. (A sharded
save's shells prepared the same way: tests/test_sharded_async.py.)"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.background import BackgroundSaveError
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.checkpoint.staging import StagingBuffer
from rewind.infra.format import pages
from rewind.infra.training.session import TrainingSession
from tests.prefect_support import wait_until

WIDTH = 1024  # 4 MiB a layer: the state (weights and AdamW's two moments) is about 50 MB
PAGE = resource.getpagesize()
_FRESH = "REWIND_TEST_FRESH_PROCESS"  # set in the child that counts the faults


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The staging copy on this thread alone, so that its page faults are this thread's to count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


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


def _pages(model: torch.nn.Module) -> int:
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) // PAGE


def _checkpointer(
    run: str, tmp_path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> Checkpointer:
    cat = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    return Checkpointer(run, states={"model": model, "optimizer": opt}, root=tmp_path / "ck", catalog=cat,
                        mode=SaveMode.ASYNC)  # fmt: skip


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "made-at-the-save"])
def test_a_prepared_first_save_faults_in_no_buffer_and_holds_the_values_of_the_call(
    run_name: str,
    tmp_path: Path,
    prepared: bool,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if pages.thp_mode() == "always":  # a fresh buffer on 2 MiB pages: a fault per 512, for both cases
        pytest.skip("THP always: a buffer's faults are not one per 4 KiB page, so the count tells nothing")
    if os.environ.get(_FRESH) != "1":  # a test process that ran other tests may hand the buffer memory
        # it already faulted in (a large free chunk of its malloc heap): the count is taken in a fresh one
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", request.node.nodeid],
            capture_output=True, text=True, timeout=240, env={**os.environ, _FRESH: "1"},
            cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
        return
    monkeypatch.setattr(pages, "_ADVISE", False)  # the buffer on 4 KiB pages (huge ones fault 512 at once)
    model, opt = _job()
    ck = _checkpointer(run_name, tmp_path, model, opt)
    cat = ck._cat
    if prepared:
        ck.prepare()
        ck.wait()
    assert lineage.checkpoints(cat, run_name) == []  # nothing saved by preparing
    held = {k: v.clone() for k, v in model.state_dict().items()}
    before = _faults()
    ck.save(1)
    faults = _faults() - before
    with torch.no_grad():  # the moment save() returned: never in the checkpoint
        for p in model.parameters():
            p.add_(1.0)
    ck.close()
    # the unprepared save faults in every page of its buffer: the measure can tell the two apart
    assert faults < 0.1 * _pages(model) if prepared else faults > 0.9 * _pages(model), faults
    again, opt2 = _job()
    ck2 = Checkpointer(
        run_name, states={"model": again, "optimizer": opt2}, root=tmp_path / "ck", catalog=cat
    )
    got = ck2.restore_latest()
    ck2.close()
    assert got is not None and got.step == 1
    assert all(torch.equal(v, held[k]) for k, v in again.state_dict().items())


def test_the_session_prepares_the_staging_memory_once_the_optimizer_has_its_state(
    run_name: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cat = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    with TrainingSession(run_name, model=model, optimizer=opt, checkpoint_every=3, mode=SaveMode.ASYNC,
                         root=tmp_path / "ck", catalog=cat) as session:  # fmt: skip
        session.report(1, 0.5)  # before the optimizer's first step: its state is not there to prepare
        _step(model, opt)
        session.report(2, 0.5)  # now it is: prepared in the background
        _step(model, opt)
        before = _faults()
        session.report(3, 0.5)  # the first save waits for the prepare, then copies alone
        faults = _faults() - before
    assert faults < 0.1 * _pages(model), faults
    assert [c.step for c in lineage.checkpoints(cat, run_name)] == [3]


def test_a_prepare_that_fails_leaves_the_buffer_to_the_first_save(
    run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(self: StagingBuffer, parts: object) -> None:
        raise MemoryError("no memory for the staging buffer now")

    monkeypatch.setattr(StagingBuffer, "prepare", no_memory)
    model, opt = _job()
    ck = _checkpointer(run_name, tmp_path, model, opt)
    cat = ck._cat
    ck.prepare()
    ck.save(1)  # neither raises the prepare's failure nor goes without a buffer
    ck.close()
    assert [(c.step, c.status) for c in lineage.checkpoints(cat, run_name)] == [(1, "committed")]


def test_a_prepare_while_a_saves_failure_is_pending_leaves_it_to_the_next_save(
    run_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _job()
    ck = _checkpointer(run_name, tmp_path, model, opt)
    cat = ck._cat
    monkeypatch.setenv("REWIND_FAULT", "eio:save.before_catalog@1")
    ck.save(1)  # fails in the background
    wait_until(lambda: (not ck._runner.busy) or None, 60, "the failed save ended")
    ck.prepare()  # the failure is the next save's to raise, not the prepare's
    with pytest.raises(BackgroundSaveError):
        ck.save(2)
    monkeypatch.delenv("REWIND_FAULT")
    ck.save(3)
    ck.close()
    assert {c.step: c.status for c in lineage.checkpoints(cat, run_name)}[3] == "committed"


def test_a_new_layout_lets_the_old_buffer_go_before_the_new_one_is_made(monkeypatch):  # type: ignore[no-untyped-def]
    """Staging memory stays one copy of the state: when the state's layout changes (a first save before the
    optimizer had its moments, then one after), the old buffer is freed before the new one is allocated,
    and a part with no tensors is part of the layout."""
    sb = StagingBuffer()
    first = {"model": {"w": torch.randn(1024, 256)}}
    staged = sb.stage(first)
    assert torch.equal(staged.parts["model"]["w"], first["model"]["w"])
    assert sb._buf is not None
    old = sb._buf.untyped_storage()  # the old buffer's memory: this reference alone once it is let go
    del staged
    made: list[int] = []
    real_empty, real_pages_empty = torch.empty, pages.empty

    def empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        if "pin_memory" in kwargs:  # the staging buffer's allocation (pinned), not another caller's
            made.append(torch._C._storage_Use_Count(old._cdata))  # who else holds it when the new one is made
        return real_empty(*args, **kwargs)

    def pages_empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(torch._C._storage_Use_Count(old._cdata))  # the staging buffer's allocation (not pinned)
        return real_pages_empty(*args, **kwargs)

    second = {"model": {"w": torch.randn(1024, 256)}, "optimizer": {"m": torch.randn(1024, 256)}}
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(pages, "empty", pages_empty)
    staged = sb.stage(second)
    monkeypatch.setattr(torch, "empty", real_empty)
    monkeypatch.setattr(pages, "empty", real_pages_empty)
    assert made and made[0] == 1, made
    assert all(torch.equal(staged.parts[p][n], second[p][n]) for p in second for n in second[p])
    third = {**second, "extra": {}}  # the same tensors, one more part with none
    assert sb.stage(third).parts["extra"] == {}
