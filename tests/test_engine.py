"""The checkpointer in-process: faults during save, sweeping, fallback, and refusing bad input."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.checkpoint.state import RNGState
from rewind.infra.errors import ConfigError
from rewind.infra.format import payload, tree


def _job(run: str, cat: Catalog, root, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extras = {"note": "hi"}
    ck = Checkpointer(
        run,
        states={"model": model, "optimizer": opt, "rng": RNGState(), "extras": extras},
        root=root,
        catalog=cat,
    )
    return model, opt, extras, ck


def _step(model, opt) -> None:  # type: ignore[no-untyped-def]
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_disk_full_during_save_is_raised_and_never_committed(rewind_env, run_name, tmp_path, monkeypatch):
    cat = Catalog()
    model, opt, _, ck = _job(run_name, cat, tmp_path / "ckpt")
    _step(model, opt)
    ck.save(1)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt)
    monkeypatch.setenv("REWIND_FAULT", "enospc:save.file_written@2")
    with pytest.raises(OSError, match="No space left"):
        ck.save(2)
    monkeypatch.delenv("REWIND_FAULT")
    statuses = {c.step: c.status for c in lineage.checkpoints(cat, run_name)}
    assert statuses == {1: "committed", 2: "aborted"}
    assert not any(".tmp-" in p.name for p in (tmp_path / "ckpt" / run_name).iterdir())
    model2, _opt2, _, ck2 = _job(run_name, cat, tmp_path / "ckpt", seed=99)
    assert ck2.restore_latest().step == 1
    for k, v in model2.state_dict().items():
        assert torch.equal(v, good[k])


def test_stale_temp_dirs_are_swept(rewind_env, run_name, tmp_path):
    run_dir = tmp_path / "ckpt" / run_name
    stale = run_dir / "step-5.tmp-999999999-abcdef"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    _job(run_name, Catalog(), tmp_path / "ckpt")
    assert not stale.exists()


def test_extras_and_reserved_names(rewind_env, run_name, tmp_path):
    cat = Catalog()
    _model, _opt, extras, ck = _job(run_name, cat, tmp_path / "ckpt")
    extras["tokens_seen"] = 1234
    ck.save(1)
    extras.clear()
    _, _, extras2, ck2 = _job(run_name, cat, tmp_path / "ckpt")  # fresh objects, as another process builds
    ck2.restore_latest()
    assert extras2 == {"note": "hi", "tokens_seen": 1234}
    with pytest.raises(ConfigError, match="reserved"):
        Checkpointer(run_name, states={"state.json": {}}, root=tmp_path, catalog=cat)
    with pytest.raises(Exception, match="escapes"):
        Checkpointer(run_name, states={"../x": {}}, root=tmp_path, catalog=cat)


def test_a_second_live_writer_is_refused_by_name(rewind_env, run_name, tmp_path):
    """Two processes training one run would fork its timeline: the second stops at start, in one line."""
    import socket

    from tests.trainproc import TrainProc

    root = tmp_path / "ckpt"
    _, _, _, first = _job(run_name, Catalog(), root)  # this process holds the run
    second = TrainProc(
        run_name, tmp_path / "out", env={"REWIND_CHECKPOINT_ROOT": str(root)}, extra=["--stop-after", "2"]
    )
    second.finish()
    assert second.proc.returncode == 2, second.output.text
    refusal = [line for line in second.output.lines if "is being written by" in line]
    assert refusal and f"{socket.gethostname()}:{__import__('os').getpid()}" in refusal[0], second.output.text
    first.close()  # let go: now the same command runs
    third = TrainProc(
        run_name, tmp_path / "out", env={"REWIND_CHECKPOINT_ROOT": str(root)}, extra=["--stop-after", "2"]
    )
    third.finish()
    assert third.proc.returncode == 0, third.output.text


def test_a_writer_saving_less_often_than_its_lease_lives_is_not_presumed_gone(
    rewind_env, run_name, tmp_path, monkeypatch
):
    """A job whose saves are hours apart keeps its run: between saves its lease is renewed, so a second
    job of the run is still refused (and a roll-back still waits) after the lease's time to live."""
    from datetime import timedelta

    from sqlalchemy import update

    from rewind.infra.catalog import leases, writer_lease
    from rewind.infra.catalog.models import Run, utcnow
    from rewind.infra.errors import RunBusy
    from tests.prefect_support import wait_until

    monkeypatch.setattr(writer_lease, "beat_s", lambda: 0.05)
    cat = Catalog()
    *_, ck = _job(run_name, cat, tmp_path / "ckpt")
    try:
        with cat.session() as s:  # an hour and more without a save, as between two saves of a large model
            aged = utcnow() - timedelta(hours=2)
            s.execute(update(Run).where(Run.id == ck.run_id).values(writer_seen_at=aged))
        me = wait_until(lambda: leases.live_writer(cat, run_name), 10, "the writer lease renewed")
        assert me == leases.writer_name()
        with pytest.raises(RunBusy, match="is being written by"):
            leases.take_writer(cat, ck.run_id, who="elsewhere:1")
    finally:
        ck.close()
    assert leases.live_writer(cat, run_name) is None  # let go at close, and no longer renewed
    leases.take_writer(cat, ck.run_id, who="elsewhere:1")


def test_a_writer_lease_is_not_held_past_a_failed_start_nor_renewed_for_ever(
    rewind_env, run_name, tmp_path, monkeypatch
):
    """A checkpointer that fails to start holds no lease; one left open (a notebook whose training raised)
    stops renewing its lease a while after its last save, so the run is not held for the process's life."""
    from datetime import timedelta

    from sqlalchemy import update

    from rewind.infra.catalog import leases, writer_lease
    from rewind.infra.catalog.models import Run, utcnow

    cat = Catalog()
    with pytest.raises(ValueError, match="bogus"):
        Checkpointer(run_name, states={"x": {"a": 1}}, root=tmp_path / "ckpt", catalog=cat, mode="bogus")
    assert leases.live_writer(cat, run_name) is None
    monkeypatch.setattr(writer_lease, "beat_s", lambda: 0.05)
    monkeypatch.setattr(writer_lease, "SILENT_MAX_S", 0.0)
    *_, ck = _job(run_name, cat, tmp_path / "ckpt")
    try:
        beat = ck._lease._thread
        assert beat is not None
        beat.join(timeout=10)
        assert not beat.is_alive()  # no save since the take: the renewal gave up
        with cat.session() as s:
            aged = utcnow() - timedelta(hours=2)
            s.execute(update(Run).where(Run.id == ck.run_id).values(writer_seen_at=aged))
        assert leases.live_writer(cat, run_name) is None
    finally:
        ck.close()


def test_a_training_session_whose_start_fails_lets_go_of_the_run(rewind_env, run_name, tmp_path):
    """A session whose restore fails (the model no longer fits the run's checkpoint) has no ``with`` body to
    close it: it must let go of the run itself, or another job of the run is refused while this process
    lives (a notebook's kernel: for as long as the lease is renewed)."""
    from rewind.infra.catalog import leases
    from rewind.infra.training.session import TrainingSession

    cat, root = Catalog(), tmp_path / "ckpt"
    with TrainingSession(run_name, model=torch.nn.Linear(4, 4), root=root, catalog=cat) as session:
        session.save(1)
    with pytest.raises(Exception, match=r"size mismatch|shape"):
        TrainingSession(run_name, model=torch.nn.Linear(4, 5), root=root, catalog=cat).__enter__()
    assert leases.live_writer(cat, run_name) is None
    leases.take_writer(cat, lineage.get_run(cat, run_name).id, who="elsewhere:1")


def test_a_checkpointer_dropped_unclosed_leaves_no_renewal_holding_its_catalog(
    rewind_env, run_name, tmp_path, monkeypatch
):
    """A checkpointer the program drops without closing it is collected with its catalog's connections, as
    before leases were renewed: the renewal thread holds neither (many such would exhaust Postgres)."""
    import gc

    from rewind.infra.catalog import writer_lease

    monkeypatch.setattr(writer_lease, "beat_s", lambda: 0.05)
    *_, ck = _job(run_name, Catalog(), tmp_path / "ckpt")
    beat = ck._lease._thread
    assert beat is not None and beat.is_alive()
    del ck, _
    gc.collect()
    beat.join(timeout=10)
    assert not beat.is_alive()


def test_secrets_on_the_command_line_never_reach_a_manifest(rewind_env, run_name, tmp_path, monkeypatch):
    import json
    import sys

    monkeypatch.setattr(sys, "argv", ["train.py", "--token=tok-123", "--password", "hunter2", "HF_TOKEN=hf-9",
                                      "--db", "postgresql://me:pw-7@db/x", "--lr", "0.1"])  # fmt: skip
    _, _, _, ck = _job(run_name, Catalog(), tmp_path / "ckpt")
    ck.save(1)
    ck.close()
    raw = (tmp_path / "ckpt" / run_name / "step-1" / "manifest.json").read_text()
    for secret in ("tok-123", "hunter2", "hf-9", "pw-7"):
        assert secret not in raw
    assert "--lr 0.1" in json.loads(raw)["environment"]["argv"]  # the rest of the command line stays
    (row,) = lineage.checkpoints(Catalog(), run_name)
    assert "hunter2" not in json.dumps(row.environment)


_DATALESS = {
    "meta": lambda: torch.empty(3, device="meta"),
    "sparse": lambda: torch.eye(3).to_sparse(),
    "sparse-csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", sorted(_DATALESS))
def test_a_tensor_without_dense_data_is_a_one_line_error_and_nothing_is_committed(
    rewind_env, run_name, tmp_path, kind, mode
):
    """A meta, sparse or quantized tensor in the state is named at save (not torch's error from the staging
    copy); the run's earlier checkpoint stays the one restored, and the next save of a dense state lands."""
    cat = Catalog()
    extras: dict = {"t": torch.ones(3)}
    ck = Checkpointer(run_name, states={"extras": extras}, root=tmp_path / "ckpt", catalog=cat, mode=mode)
    ck.save(1)
    extras["t"] = _DATALESS[kind]()
    with pytest.raises(ConfigError, match=r"^the tensor at 'extras\.t' is "):
        ck.save(2)
    ck.wait()
    assert [c.step for c in lineage.checkpoints(cat, run_name) if c.status == "committed"] == [1]
    extras["t"] = torch.full((3,), 2.0)
    ck.save(3)
    ck.wait()
    ck.close()
    again: dict = {}
    ck2 = Checkpointer(run_name, states={"extras": again}, root=tmp_path / "ckpt", catalog=cat)
    assert ck2.restore_latest().step == 3
    assert torch.equal(again["t"], torch.full((3,), 2.0))
    ck2.close()


class _Growing(torch.nn.Module):
    """A module that grows a buffer in place (``resize_``), as a cache or a running record of steps does."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = torch.nn.Parameter(torch.zeros(8))
        self.register_buffer("record", torch.arange(4.0))

    def grow(self) -> None:
        n = self.record.numel()
        self.record.resize_(n + 4)
        self.record[n:] = torch.arange(n, n + 4.0)


@pytest.mark.parametrize("fmt", ["plain", "chunked"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_leaves_the_jobs_tensors_as_they_were(rewind_env, run_name, tmp_path, mode, fmt):
    """A job's tensors can still be resized in place after a checkpoint of them (a save never marks their
    storage not resizable, as exporting them to numpy would), and the checkpoint holds the values of the
    call."""
    cat, job = Catalog(), _Growing()
    ck = Checkpointer(
        run_name, states={"job": job}, root=tmp_path / "ckpt", catalog=cat, mode=mode, format=fmt
    )
    for step in (1, 2):
        job.seen.data.fill_(float(step))
        ck.save(step)
        ck.wait()
        job.grow()  # torch: "Trying to resize storage that is not resizable" after a save that exported it
        job.seen.data.resize_(8 * (step + 1))  # the parameter's storage grows; the parameter keeps 8
    ck.close()
    assert torch.equal(job.record, torch.arange(12.0))
    again = _Growing()
    again.record.resize_(8)
    ck2 = Checkpointer(run_name, states={"job": again}, root=tmp_path / "ckpt", catalog=cat, format=fmt)
    got = ck2.restore_latest()
    assert got is not None and got.step == 2
    assert torch.equal(again.record, torch.arange(8.0)) and torch.equal(again.seen, torch.full((8,), 2.0))
    ck2.close()


@pytest.mark.parametrize("fmt", ["plain", "chunked"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lazily_conjugated_and_negated_tensors_are_saved_as_their_values(
    rewind_env, run_name, tmp_path, mode, fmt
):
    """A tensor whose bytes are not its values (a lazy ``conj()``, the ``imag`` of one: torch's conjugate and
    negative bits) is saved as its values, each alone and lying back to back with another in one storage."""
    cat = Catalog()
    z = torch.tensor([1 - 2j, 3 + 4j, -5 + 6j, 7 - 8j], dtype=torch.complex64)
    both = torch.arange(8.0)
    extras: dict = {"conj": z.conj(), "neg": z.conj().imag, "first": both[:4], "second": both[4:]._neg_view()}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in extras.items()}
    ck = Checkpointer(
        run_name, states={"extras": extras}, root=tmp_path / "ckpt", catalog=cat, mode=mode, format=fmt
    )
    ck.save(1)
    ck.wait()
    ck.close()
    again: dict = {}
    ck2 = Checkpointer(run_name, states={"extras": again}, root=tmp_path / "ckpt", catalog=cat, format=fmt)
    assert ck2.restore_latest().step == 1
    assert {k: v.tolist() for k, v in again.items()} == {k: v.tolist() for k, v in expected.items()}
    ck2.close()


@pytest.mark.parametrize("fmt", ["plain", "chunked"])
def test_two_states_holding_a_tensor_of_one_name_are_refused_at_save(
    rewind_env, run_name, tmp_path, monkeypatch, fmt
):
    """State ``model``'s ``ema.weight`` and state ``model.ema``'s ``weight`` would both be the tensor
    ``model.ema.weight``: the save is a one-line error naming both, nothing is committed. A checkpoint that
    holds such a pair (saved before the refusal) is passed over for the one before it, never loaded with
    one state's tensor in the other."""
    cat = Catalog()
    model: dict = {"w": torch.zeros(2)}
    ema: dict = {"weight": torch.ones(2)}
    ck = Checkpointer(
        run_name, states={"model": model, "model.ema": ema}, root=tmp_path / "ckpt", catalog=cat, format=fmt
    )
    ck.save(1)
    model["ema.weight"] = torch.full((2,), 7.0)
    with pytest.raises(
        ConfigError, match=r"^states 'model' and 'model.ema' both hold a tensor named 'model.ema.weight'"
    ):
        ck.save(2)
    assert [c.step for c in lineage.checkpoints(cat, run_name) if c.status == "committed"] == [1]

    def unchecked(state_dicts):  # type: ignore[no-untyped-def]  # as saves did before the refusal
        split = {part: tree.split(sd, part) for part, sd in state_dicts.items()}
        return {p: s[0] for p, s in split.items()}, {p: s[1] for p, s in split.items()}

    monkeypatch.setattr(payload, "split_states", unchecked)
    ck.save(3)
    ck.close()
    monkeypatch.undo()
    again: dict = {}
    again_ema: dict = {}
    ck2 = Checkpointer(
        run_name,
        states={"model": again, "model.ema": again_ema},
        root=tmp_path / "ckpt",
        catalog=cat,
        format=fmt,
    )
    got = ck2.restore_latest()
    assert got is not None and got.step == 1 and [s.step for s in got.skipped] == [3]
    assert torch.equal(again_ema["weight"], torch.ones(2)) and set(again) == {"w"}
    ck2.close()


def test_a_refused_random_state_changes_no_generator() -> None:
    """An RNG state one generator refuses leaves every generator as it was, not some set and some not."""
    rng = RNGState()
    bad = dict(rng.state_dict(), torch=torch.zeros(3, dtype=torch.uint8))  # not a torch generator's state
    random.seed(11)
    np.random.seed(11)
    python, numpy_state = random.getstate(), np.random.get_state()[1].copy()
    with pytest.raises(RuntimeError):
        rng.load_state_dict(bad)
    assert random.getstate() == python and np.array_equal(np.random.get_state()[1], numpy_state)


@pytest.mark.parametrize("fmt", ["plain", "chunked"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tensors_come_back_in_their_layout_as_torch_load_gives_them(
    rewind_env, run_name, tmp_path, mode, fmt
):
    """An optimizer's state of a ``channels_last`` convolution comes back ``channels_last``, like its
    parameter (a fused optimizer refuses mixed layouts), and a transposed tensor kept in a dict comes back
    transposed: the strides ``torch.load`` gives (a 1x1 convolution's too, whose size-1 dimensions'
    strides torch's ``is_contiguous`` ignores), the values bit-exact. Its manifest says a format an older
    Rewind refuses as too new (it would load the layouts as dicts)."""
    torch.manual_seed(5)

    def job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        conv = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 8, 1))
        conv = conv.to(memory_format=torch.channels_last)
        return conv, torch.optim.Adam(conv.parameters(), lr=1e-2)

    conv, opt = job()
    conv(torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    opt.step()
    extras: dict = {"t": torch.randn(5, 3).t()}
    states = {"model": conv, "optimizer": opt, "extras": extras}
    ck = Checkpointer(
        run_name, states=states, root=tmp_path / "ckpt", catalog=Catalog(), mode=mode, format=fmt
    )
    ck.save(1)
    ck.wait()
    ck.close()
    assert json.loads((tmp_path / "ckpt" / run_name / "step-1" / "manifest.json").read_bytes())["format"] == (
        "rewind.checkpoint/5"
    )
    reference = torch.load(_saved_by_torch(tmp_path, states), weights_only=True)

    conv2, opt2 = job()
    extras2: dict = {}
    ck2 = Checkpointer(
        run_name,
        states={"model": conv2, "optimizer": opt2, "extras": extras2},
        root=tmp_path / "ckpt",
        format=fmt,
    )
    assert ck2.restore_latest().step == 1
    ck2.close()
    pairs = [(extras2["t"], reference["extras"]["t"])]
    for i, p in enumerate(conv2.parameters()):
        pairs += [
            (opt2.state[p][k], reference["optimizer"]["state"][i][k]) for k in ("exp_avg", "exp_avg_sq")
        ]
        assert opt2.state[p]["exp_avg"].stride() == p.stride()
    for got, want in pairs:
        assert got.stride() == want.stride() and torch.equal(got, want)


def _saved_by_torch(tmp_path, states):  # type: ignore[no-untyped-def]
    path = tmp_path / "torch.pt"
    torch.save(
        {k: (v.state_dict() if hasattr(v, "state_dict") else dict(v)) for k, v in states.items()}, path
    )
    return path
