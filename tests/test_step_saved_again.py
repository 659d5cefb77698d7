"""A step saved again replaces the step's checkpoint only when the new save commits: one that fails (a full
disk, a catalog gone at the commit, a writer that died) leaves the old one restorable, bit-exact."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rewind.infra import retention
from rewind.infra.catalog import commits, copies, lineage, moved_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.checkpoint import displaced
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.errors import CatalogUnavailable, Fenced


@pytest.fixture(params=["sqlite", "postgres"])
def cat(request, rewind_env, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        monkeypatch.setenv("REWIND_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    return Catalog()


def _job(run: str, cat: Catalog, root: Path, seed: int) -> tuple[torch.nn.Module, Checkpointer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 256)
    return model, Checkpointer(run, states={"model": model}, root=root, catalog=cat)


def _restores(cat: Catalog, run: str, root: Path) -> tuple[int, dict[str, torch.Tensor]]:
    model, ck = _job(run, cat, root, seed=99)
    got = ck.restore_latest()
    assert got is not None
    return got.step, model.state_dict()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's state as it is now."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def _change(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.weight.add_(1.0)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _statuses(cat: Catalog, run: str, step: int) -> list[str]:
    return [str(c.status) for c in sorted(lineage.checkpoints(cat, run, step), key=lambda c: c.id)]


@pytest.mark.parametrize("point", ["save.file_written", "save.before_catalog"])
def test_a_step_saved_again_that_fails_leaves_the_steps_checkpoint_restorable(
    cat, run_name, tmp_path, monkeypatch, point
):  # type: ignore[no-untyped-def]
    """Failing while its files are written, or after its rename when the catalog's commit fails: the step's
    committed checkpoint stays committed and restores bit-exact (before, it was superseded and moved aside
    when the new save began: the run fell back to the step before)."""
    root = tmp_path / "ckpt"
    model, ck = _job(run_name, cat, root, seed=0)
    ck.save(3)
    _change(model)
    ck.save(5)
    at_five = _state(model)
    with torch.no_grad():
        model.weight.mul_(-1.0)
    monkeypatch.setenv("REWIND_FAULT", f"enospc:{point}@5")
    with pytest.raises(OSError, match="No space left"):
        ck.save(5)
    monkeypatch.delenv("REWIND_FAULT")
    assert _statuses(cat, run_name, 5) == ["committed", "aborted"]
    step, path, restored = _path_restored(cat, run_name, root)
    assert (step, path) == (5, str(root / run_name / "step-5")) and _same(restored, at_five)  # put back


def test_a_step_saved_again_supersedes_the_old_checkpoint_when_it_commits(cat, run_name, tmp_path):  # type: ignore[no-untyped-def]
    root = tmp_path / "ckpt"
    model, ck = _job(run_name, cat, root, seed=0)
    ck.save(5)
    _change(model)
    ck.save(5)
    again = _state(model)
    assert _statuses(cat, run_name, 5) == ["superseded", "committed"]
    step, restored = _restores(cat, run_name, root)
    assert step == 5 and _same(restored, again)
    moved = [p for p in (root / run_name / ".quarantine").iterdir() if "superseded" in p.name]
    assert len(moved) == 1  # the old copy moved aside at the rename, not removed


def test_a_writer_that_died_saving_a_step_again_leaves_the_old_copy_in_place(cat, run_name, tmp_path):  # type: ignore[no-untyped-def]
    """The next start settles the dead writer's row; the directory at the step is the committed checkpoint's,
    not the dead save's (it never got to its rename): it stays where it is."""
    root = tmp_path / "ckpt"
    model, ck = _job(run_name, cat, root, seed=0)
    ck.save(5)
    at_five = _state(model)
    final = root / run_name / "step-5"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)  # exited: no process has this pid now (checked below)
    run_id = lineage.get_run(cat, run_name).id
    commits.begin(cat, run_id, 5, str(final), parent_id=None, layout={},
                  environment={"hostname": socket.gethostname(), "pid": pid})  # fmt: skip
    ck.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    step, restored = _restores(cat, run_name, root)
    assert _statuses(cat, run_name, 5) == ["verified", "aborted"]  # the restore proved it
    assert step == 5 and _same(restored, at_five) and (final / "manifest.json").is_file()


def _path_restored(cat: Catalog, run: str, root: Path) -> tuple[int, str, dict[str, torch.Tensor]]:
    model, ck = _job(run, cat, root, seed=99)
    got = ck.restore_latest()
    assert got is not None
    return got.step, got.path, model.state_dict()


def test_a_save_fenced_off_since_it_began_never_moves_a_newer_saves_checkpoint(cat, run_name, tmp_path):  # type: ignore[no-untyped-def]
    """An orphaned writer whose save of a step began before the live writer committed that step (a later row)
    is refused at its rename: the live checkpoint's directory stays where it is."""
    root = tmp_path / "ckpt"
    _, ck = _job(run_name, cat, root, seed=0)
    ck.save(5)
    assert ck.last_saved is not None
    final = root / run_name / "step-5"
    earlier = displaced.Displacer(
        cat, lineage.get_run(cat, run_name).id, 5, ck.last_saved.checkpoint_id - 1, None
    )
    with pytest.raises(Fenced, match="later save"):
        earlier(final)
    assert (final / "manifest.json").is_file() and not (root / run_name / ".quarantine").exists()


def test_a_catalog_that_fails_while_the_old_copy_is_moved_aside_leaves_it_in_place(
    cat, run_name, tmp_path, monkeypatch
):  # type: ignore[no-untyped-def]
    root = tmp_path / "ckpt"
    model, ck = _job(run_name, cat, root, seed=0)
    ck.save(5)
    at_five = _state(model)
    _change(model)

    def unreachable(*_: object) -> None:
        raise CatalogUnavailable("catalog unreachable (injected)")

    monkeypatch.setattr(moved_copies, "moved", unreachable)
    with pytest.raises(CatalogUnavailable):
        ck.save(5)
    monkeypatch.undo()
    step, path, restored = _path_restored(cat, run_name, root)
    assert (step, path) == (5, str(root / run_name / "step-5")) and _same(restored, at_five)


def test_the_next_start_puts_back_a_copy_a_dead_writer_moved_aside(cat, run_name, tmp_path):  # type: ignore[no-untyped-def]
    """A writer killed between moving the step's checkpoint aside and its commit, its own copy renamed in:
    the next start moves that copy out and the checkpoint back, rows following; nothing gc could take."""
    root = tmp_path / "ckpt"
    model, ck = _job(run_name, cat, root, seed=0)
    ck.save(5)
    at_five = _state(model)
    ck.close()
    final = root / run_name / "step-5"
    run_id = lineage.get_run(cat, run_name).id
    new = commits.begin(cat, run_id, 5, str(final), parent_id=None, layout={},
                        environment={"hostname": socket.gethostname(), "pid": _dead_pid()})  # fmt: skip
    displaced.Displacer(cat, run_id, 5, new, None)(final)
    final.mkdir()
    (final / "manifest.json").write_text('{"dead": "save"}')  # its rename done, its commit never
    aside = root / run_name / ".quarantine"
    plan = retention.plan(cat, run_name, retention.Policy(grace_s=0), root=root)
    assert not any(p.name.startswith("step-5-superseded") for p in plan.quarantine)  # still the run's
    step, path, restored = _path_restored(cat, run_name, root)
    assert (step, path) == (5, str(final)) and _same(restored, at_five)
    assert [p.name.split("-")[2] for p in aside.iterdir()] == ["uncommitted"]


def _dead_pid() -> int:
    pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                             text=True, check=True).stdout)  # fmt: skip
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    return pid


def test_a_corrupt_checkpoint_at_the_step_is_superseded_with_why_it_was_corrupt(cat, run_name, tmp_path):  # type: ignore[no-untyped-def]
    _, ck = _job(run_name, cat, tmp_path / "ckpt", seed=0)
    ck.save(5)
    assert ck.last_saved is not None
    old = ck.last_saved.checkpoint_id
    assert lineage.transition(cat, old, (S.COMMITTED,), S.CORRUPT, "no copy verifies: local: corrupt")
    ck.save(5)
    [was] = [c for c in lineage.checkpoints(cat, run_name, 5) if c.id == old]
    assert str(was.status) == "superseded"
    assert (
        was.status_reason
        == "superseded by a new save at step 5 (it was corrupt: no copy verifies: local: corrupt)"
    )


def test_a_save_still_writing_the_step_is_aborted_when_another_commits_it(cat, run_name, tmp_path):  # type: ignore[no-untyped-def]
    """A save of the step begun elsewhere and never committed (a writer that stalled mid-save) is aborted,
    saying why, by the save that commits the step, with the step's pinned checkpoint superseded and its pin
    moved: one live checkpoint a step. A save still writing another step is left alone."""
    root = tmp_path / "ckpt"
    _, ck = _job(run_name, cat, root, seed=0)
    ck.save(5)
    assert lineage.set_pinned(cat, run_name, 5, True) == 1
    run_id = lineage.get_run(cat, run_name).id

    def begun(step: int) -> int:
        final = str(root / run_name / f"step-{step}")
        return commits.begin(cat, run_id, step, final, parent_id=None, layout={}, environment={})

    stalled, elsewhere = begun(5), begun(7)
    ck.save(5)
    rows = sorted(lineage.checkpoints(cat, run_name, 5), key=lambda c: c.id)
    assert [(str(c.status), c.pinned) for c in rows] == [
        ("superseded", False),
        ("aborted", False),
        ("committed", True),
    ]
    assert rows[1].id == stalled and rows[1].status_reason == "superseded by a new save at step 5"
    [other] = lineage.checkpoints(cat, run_name, 7)
    assert (other.id, str(other.status)) == (elsewhere, "writing")


def test_what_a_failed_save_could_not_put_back_the_next_start_does(cat, run_name, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """The save fails after its rename and its catalog fails again while it puts the old copy back: that copy
    stays aside (rows following it), gc keeps it, and the next start puts it back."""
    root = tmp_path / "ckpt"
    model, ck = _job(run_name, cat, root, seed=0)
    ck.save(5)
    at_five = _state(model)
    real = moved_copies.moved

    def put_back_fails(c: Catalog, old: str, new: str, reason: str) -> None:
        if reason.startswith("put back"):
            raise CatalogUnavailable("catalog unreachable (injected)")
        real(c, old, new, reason)

    monkeypatch.setattr(moved_copies, "moved", put_back_fails)
    monkeypatch.setenv("REWIND_FAULT", "enospc:save.before_catalog@5")
    with pytest.raises(OSError, match="No space left"):
        ck.save(5)
    monkeypatch.undo()
    monkeypatch.delenv("REWIND_FAULT", raising=False)
    final = root / run_name / "step-5"
    assert not final.exists()  # the failed save's copy moved out; the old one still aside
    plan = retention.plan(cat, run_name, retention.Policy(grace_s=0), root=root)
    assert not any("superseded" in p.name for p in plan.quarantine)
    ck.close()
    step, path, restored = _path_restored(cat, run_name, root)  # a new writer's start puts it back
    assert (step, path) == (5, str(final)) and _same(restored, at_five)


def test_bytes_put_back_half_way_are_finished_by_the_next_start(cat, run_name, tmp_path):  # type: ignore[no-untyped-def]
    """Killed between the catalog's part of a put back (rows naming the step again) and the rename: the next
    start finds the checkpoint aside by its manifest and renames it in."""
    root = tmp_path / "ckpt"
    model, ck = _job(run_name, cat, root, seed=0)
    ck.save(5)
    at_five = _state(model)
    ck.close()
    final = root / run_name / "step-5"
    run_id = lineage.get_run(cat, run_name).id
    d = displaced.Displacer(cat, run_id, 5, 10**9, None)
    d(final)
    assert d.moved is not None
    moved_copies.moved(cat, str(d.moved[1]), str(final), "put back (the rename never came)")
    step, path, restored = _path_restored(cat, run_name, root)
    assert (step, path) == (5, str(final)) and _same(restored, at_five)


def test_a_pin_on_the_step_moves_to_the_checkpoint_that_replaces_it(cat, run_name, tmp_path):  # type: ignore[no-untyped-def]
    _, ck = _job(run_name, cat, tmp_path / "ckpt", seed=0)
    ck.save(5)
    assert lineage.set_pinned(cat, run_name, 5, True) == 1
    ck.save(5)
    pins = {str(c.status): c.pinned for c in lineage.checkpoints(cat, run_name, 5)}
    assert pins == {"superseded": False, "committed": True}


def test_a_gc_plan_made_before_the_step_was_saved_again_leaves_the_new_checkpoint_alone(
    cat, run_name, tmp_path
):  # type: ignore[no-untyped-def]
    """A gc planned to reclaim a condemned checkpoint's copy at step 5; the step is saved again (the old copy
    moved aside, its row following it) before the plan is carried out: the new checkpoint at step 5 stays
    (before, the plan's path, step-5, was deleted: the new committed checkpoint's directory)."""
    root = tmp_path / "ckpt"
    model, ck = _job(run_name, cat, root, seed=0)
    ck.save(3)
    ck.save(5)
    assert ck.last_saved is not None
    assert copies.condemn(cat, ck.last_saved.checkpoint_id, "its state does not load")
    policy = retention.Policy(grace_s=0)
    plan = retention.plan(cat, run_name, policy, root=root)
    assert [r.step for r in plan.reclaim] == [5]
    _change(model)
    ck.save(5)
    at_five = _state(model)
    ck.close()
    retention.execute(cat, plan, policy)
    step, restored = _restores(cat, run_name, root)
    assert step == 5 and _same(restored, at_five)
