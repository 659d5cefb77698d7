"""The memory tier: a node's newest committed checkpoint held in shared memory (tmpfs) by an agent beside
the job. A crashed job resumes from it reading nothing from disk (counted); a damaged memory copy is
refused and removed, and the local copy used; a run's older memory copies are let go within the count and
the budget; a memory copy never makes a checkpoint verified (it is volatile)."""

from __future__ import annotations

import ctypes
import gc
import io
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rewind.infra.catalog import copies, incidents, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint import own_tensors
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.drills import chaos
from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import dropping, mapped, pids, tensorfile
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_bytes, manifest_digest
from rewind.infra.memory import keeper, place, ring_room
from tests.prefect_support import wait_until
from tests.test_protect_any_job import config, protect, ranks_at


def _memory_copies(cat: Catalog, run: str) -> dict[int, list[copies.Replica]]:
    return {
        ck.step: [r for r in lineage.replicas_of(cat, ck.id) if r.tier == copies.MEMORY]
        for ck in lineage.checkpoints(cat, run)
    }


def _job(run: str, cat: Catalog, root: Path, width: int = 64) -> tuple[torch.nn.Module, Checkpointer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    return model, Checkpointer(run, states={"model": model}, root=root, catalog=cat)


def _saved(ck: Checkpointer, step: int) -> int:
    """The id of the checkpoint ``step`` saved (synchronously)."""
    ck.save(step)
    assert ck.last_saved is not None and ck.last_saved.step == step
    return ck.last_saved.checkpoint_id


@pytest.mark.parametrize("width", [64, 1024], ids=["copied", "mapped"])  # 16 KiB read, 4 MiB mapped
def test_a_damaged_memory_copy_is_refused_removed_and_the_local_copy_used(
    rewind_env, run_name, tmp_path, memory_root, width
):  # type: ignore[no-untyped-def]
    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    _model, ck = _job(run_name, cat, tmp_path / "ckpt", width)
    saved = _saved(ck, 1)
    kept = keeper.keep(cat, saved, cfg)
    assert kept is not None and kept.directory.is_relative_to(memory_root) and kept.nbytes > 0
    assert lineage.get_checkpoint(cat, saved).status == "committed"  # volatile: proves nothing
    biggest = max((p for p in kept.directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    biggest.write_bytes(bytes(data))

    _, again = _job(run_name, cat, tmp_path / "ckpt", width)
    got = again.restore_latest()
    assert got is not None and got.source == "local" and got.step == 1
    [mem] = _memory_copies(cat, run_name)[1]
    assert mem.status == R.CORRUPT.value and not kept.directory.exists()
    left = [p for p in memory_root.rglob("*") if p.is_file() and p.name.endswith(".safetensors")]
    assert not left, left  # removed, not moved aside in memory (where nothing would ever free it)


class _Holder(torch.nn.Module):
    """A module whose tensors are buffers (one of them empty)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in state.items():
            self.register_buffer(k, v.clone())
        self.register_buffer("none", torch.empty(0))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.named_buffers() if k != "none"}


class _Assigning(_Holder):
    """Keeps the tensors it is given instead of copying them."""

    def load_state_dict(self, state_dict, strict=True, assign=False):  # type: ignore[no-untyped-def]
        return super().load_state_dict(state_dict, strict=strict, assign=True)


class _Extra(_Holder):
    """Its tensors in an extra state, which it keeps as given."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__({})
        self.extra = {k: v.clone() for k, v in state.items()}

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return self.extra

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.extra = state

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.extra


def _mapped_from(root: Path) -> list[str]:
    """This process's mappings of files under ``root``, once what restores let go is dropped."""
    assert dropping.dropped(timeout=30)
    gc.collect()
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(root) in line]


@pytest.mark.parametrize(
    "kind", [_Holder, _Assigning, _Extra, dict], ids=["module", "assigning", "extra", "dict"]
)
def test_what_a_job_restores_from_memory_is_its_own_the_memory_copy_never_changes(
    rewind_env, run_name, tmp_path, memory_root, kind, monkeypatch
):  # type: ignore[no-untyped-def]
    """A module's part is read from memory over the tier's pages, copy-on-write; what the job holds after
    the load is its own whatever its state object keeps: its writes never reach the memory copy, the copy
    let go leaves its tensors intact, and it maps none of the tier's files afterwards (their memory freed)."""
    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    torch.manual_seed(1)
    saved = {"w": torch.randn(1024, 1024), "b": torch.randn(1024).to(torch.bfloat16)}  # 4 MiB: mapped

    def job(state: dict[str, torch.Tensor]) -> tuple[Any, Checkpointer]:
        holder = kind(state) if kind is not dict else state
        ck = Checkpointer(run_name, states={"part": holder}, root=tmp_path / "ckpt", catalog=cat)
        return (holder.tensors if kind is not dict else lambda: holder), ck

    _, ck = job(dict(saved))
    kept = keeper.keep(cat, _saved(ck, 1), cfg)
    assert kept is not None
    maps, loads = mapped.verified_mapping, mapped.verified_into
    made: list[str] = []  # the files read over a mapping, or loaded from it into the module's own tensors

    def spy(directory: Path, entry: mf.FileEntry) -> memoryview | None:
        view = maps(directory, entry)
        made.extend([entry.path] if view is not None else [])
        return view

    def spy_into(directory: Path, entry: mf.FileEntry, into: Any) -> bool:
        done = loads(directory, entry, into)
        made.extend([entry.path] if done else [])
        return done

    monkeypatch.setattr(mapped, "verified_mapping", spy)
    monkeypatch.setattr(mapped, "verified_into", spy_into)
    first, ck = job({k: torch.zeros_like(v) for k, v in saved.items()})
    got = ck.restore_latest()
    assert got is not None and got.source == "memory"
    assert all(torch.equal(first()[k], v) for k, v in saved.items())
    first()["w"].mul_(-1)
    first()["b"].add_(1)

    again, ck = job({k: torch.zeros_like(v) for k, v in saved.items()})
    got = ck.restore_latest()
    assert got is not None and got.source == "memory"  # proved itself: the job's writes stayed the job's
    assert made == (["part.safetensors"] * 2 if kind is _Holder else [])  # only torch's own loading maps
    assert _mapped_from(memory_root) == []
    keeper.remove(kept.directory)  # let go while the job still holds what it restored
    assert all(torch.equal(again()[k], v) for k, v in saved.items())
    assert torch.equal(first()["w"], -saved["w"]) and torch.equal(first()["b"], saved["b"] + 1)


def test_which_state_objects_are_read_over_a_mapping_and_a_module_left_on_one_gets_its_own():
    class Hooked(torch.nn.Linear):
        pass

    hooked = Hooked(4, 4)
    hooked.register_load_state_dict_post_hook(lambda module, keys: None)
    verdicts = [
        own_tensors.copies_on_load(o)
        for o in (
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)),
            _Assigning({}),
            _Extra({}),
            hooked,
            {"w": torch.zeros(1)},
        )
    ]
    assert verdicts == [True, False, False, False, False]

    raw = io.BytesIO()
    tensorfile.write(raw, {"weight": torch.ones(4, 4)})
    whole = bytearray(raw.getvalue())
    given, _ = tensorfile.over(memoryview(whole))
    module = torch.nn.Linear(4, 4, bias=False)
    handed = own_tensors.storages(given, module)
    module.load_state_dict(given, assign=True)  # keeps the tensor it is given, over the buffer
    assert own_tensors.own_kept(module, handed) == 1
    whole[-64:] = bytes(64)  # the buffer changes: the module's weight no longer lies over it
    assert torch.equal(module.weight, torch.ones(4, 4))


@pytest.mark.parametrize("weight", ["contiguous", "transposed"])
def test_only_parts_read_over_a_mapping_are_dropped_on_the_unmapping_thread(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch, weight
):  # type: ignore[no-untyped-def]
    """A restore from memory hands the drop thread the parts read over a mapping (a module's whose tensors
    cannot take the file's bytes in place: a transposed weight) and nothing else (an optimizer's state, read
    into tensors of its own, is dropped where it was read; a module loaded in place is given its own
    tensors, and its file's mapping is let go on the thread where it was proven)."""
    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    torch.manual_seed(2)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB: mapped
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    ck = Checkpointer(
        run_name, states={"model": model, "optimizer": opt}, root=tmp_path / "ckpt", catalog=cat
    )
    assert keeper.keep(cat, _saved(ck, 1), cfg) is not None
    handed: list[list[str]] = []
    real = own_tensors.let_go
    monkeypatch.setattr(own_tensors, "let_go", lambda states: (handed.append(sorted(states)), real(states)))
    again = torch.nn.Linear(1024, 1024)
    if weight == "transposed":
        again.weight = torch.nn.Parameter(torch.empty(1024, 1024).t())
    ck = Checkpointer(
        run_name, states={"model": again, "optimizer": torch.optim.AdamW(again.parameters())},
        root=tmp_path / "ckpt", catalog=cat,
    )  # fmt: skip
    got = ck.restore_latest()
    assert got is not None and got.source == "memory"
    assert handed == ([["model"]] if weight == "transposed" else [])
    assert torch.equal(again.weight, model.weight) and torch.equal(again.bias, model.bias)
    assert _mapped_from(memory_root) == []


def test_the_flip_byte_drill_never_changes_a_file_a_restore_mapped(memory_root):  # type: ignore[no-untyped-def]
    memory_root.mkdir(parents=True)
    data = os.urandom(2 << 20)
    d = hash_bytes(data)
    (memory_root / "x.safetensors").write_bytes(data)
    view = mapped.verified_mapping(memory_root, mf.FileEntry("x.safetensors", d.size, d.xxh3, d.crc32c))
    assert view is not None
    chaos._flip(memory_root / "x.safetensors")
    assert (memory_root / "x.safetensors").read_bytes() != data and view == data  # the proven bytes stay
    assert [p.name for p in memory_root.iterdir()] == ["x.safetensors"]  # no temporary file left


def test_a_file_on_a_memory_filesystem_is_mapped_only_once_it_proves(memory_root, tmp_path):  # type: ignore[no-untyped-def]
    data = os.urandom(2 << 20)
    d = hash_bytes(data)
    entry = mf.FileEntry("x.bin", d.size, d.xxh3, d.crc32c)
    for where in (memory_root, tmp_path):
        where.mkdir(parents=True, exist_ok=True)
        (where / "x.bin").write_bytes(data)
    assert mapped.in_memory(memory_root) and not mapped.in_memory(tmp_path)
    view = mapped.verified_mapping(memory_root, entry)
    assert view is not None and view == data  # mapped, every byte the entry's
    assert mapped.verified_mapping(tmp_path, entry) is None  # on a disk: read the usual way
    small = hash_bytes(data[:4096])
    (memory_root / "small.bin").write_bytes(data[:4096])
    assert mapped.verified_mapping(memory_root, mf.FileEntry("small.bin", 4096, small.xxh3, "")) is None
    damaged = bytearray(data)
    damaged[12345] ^= 1
    (memory_root / "x.bin").unlink()  # never written in place: replaced
    (memory_root / "x.bin").write_bytes(bytes(damaged))
    with pytest.raises(CorruptCheckpoint, match="xxh3"):
        mapped.verified_mapping(memory_root, entry)
    (memory_root / "x.bin").unlink()
    (memory_root / "x.bin").write_bytes(data[:-1])
    with pytest.raises(CorruptCheckpoint, match="holds"):
        mapped.verified_mapping(memory_root, entry)
    (memory_root / "x.bin").unlink()
    with pytest.raises(CorruptCheckpoint, match="not on disk"):
        mapped.verified_mapping(memory_root, entry)
    assert view == data  # the first mapping kept the bytes it proved, whatever became of the file


def test_a_mapping_faulted_in_by_helpers_span_by_span_proves_every_byte_in_order(memory_root, monkeypatch):  # type: ignore[no-untyped-def]
    """Helper threads fault a large file's pages in a span at a time while the hash follows: the bytes hashed
    are the file's in order, a damaged last span is refused, and a file cut short after it was mapped is a
    SIZE finding (a span past its end cannot be faulted in), never a SIGBUS while hashing."""
    monkeypatch.setattr(mapped, "SPAN", 1 << 20)  # 5 spans, the last a part one
    data = os.urandom((4 << 20) + 4096)
    d = hash_bytes(data)
    entry = mf.FileEntry("x.bin", d.size, d.xxh3, d.crc32c)
    memory_root.mkdir(parents=True, exist_ok=True)
    (memory_root / "x.bin").write_bytes(data)
    view = mapped.verified_mapping(memory_root, entry)
    assert view is not None and view == data
    damaged = bytearray(data)
    damaged[-1] ^= 1
    (memory_root / "x.bin").unlink()
    (memory_root / "x.bin").write_bytes(bytes(damaged))
    with pytest.raises(CorruptCheckpoint, match="xxh3"):
        mapped.verified_mapping(memory_root, entry)
    (memory_root / "x.bin").unlink()
    (memory_root / "x.bin").write_bytes(data)
    real_map = mapped._map

    def cut_after_mapping(fd: int, directory: Path, e: mf.FileEntry) -> mmap.mmap | None:
        whole = real_map(fd, directory, e)
        os.truncate(directory / e.path, 2 << 20)  # what design.md §4.1 forbids, done by something else
        return whole

    if _kernel_populates():  # before 5.14 the hash faults the pages in itself: a cut file is a SIGBUS there
        monkeypatch.setattr(mapped, "_map", cut_after_mapping)
        with pytest.raises(CorruptCheckpoint, match="holds 2097152"):
            mapped.verified_mapping(memory_root, entry)
        monkeypatch.setattr(mapped, "_map", real_map)
        (memory_root / "x.bin").unlink()
        (memory_root / "x.bin").write_bytes(data)
    assert view == data
    real_start = threading.Thread.start
    for helpers in (0, 1):  # no helper thread to be had; one started and the second refused
        start = _helpers_refused_after(helpers, real_start)
        monkeypatch.setattr(threading.Thread, "start", start)  # the span queued, its thread not started
        again = mapped.verified_mapping(memory_root, entry)
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert again is not None and again == data, helpers


def _helpers_refused_after(
    started: int, real_start: Callable[[threading.Thread], None], prefix: str = "rewind-populate"
) -> Any:
    """``Thread.start`` refusing every helper named ``prefix`` after the first ``started`` (a process limit)."""
    left = [started]

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith(prefix):
            if left[0] <= 0:
                raise RuntimeError("can't start new thread")
            left[0] -= 1
        real_start(thread)

    return start


def _kernel_populates() -> bool:
    """Whether this kernel faults pages in on ``MADV_POPULATE_READ`` (Linux 5.14 and later)."""
    with mmap.mmap(-1, mmap.PAGESIZE) as probe:
        anchor = ctypes.c_char.from_buffer(probe)
        err = mapped._populate(ctypes.addressof(anchor), mmap.PAGESIZE)
        del anchor
    return err == 0


def test_older_memory_copies_are_let_go_by_count_and_budget(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    cat = Catalog()
    _model, ck = _job(run_name, cat, tmp_path / "ckpt")
    cfg = place.config()
    assert cfg is not None
    first = keeper.keep(cat, _saved(ck, 1), cfg)
    second = keeper.keep(cat, _saved(ck, 2), cfg)
    assert first is not None and second is not None and second.evicted == (first.checkpoint_id,)
    held = _memory_copies(cat, run_name)
    assert [r.status for r in held[1]] == [R.DELETED.value] and not first.directory.exists()
    assert [r.status for r in held[2]] == [R.VERIFIED.value] and second.directory.is_dir()

    monkeypatch.setenv(place.KEEP_ENV, "5")
    monkeypatch.setenv(place.BUDGET_ENV, str(int(second.nbytes * 1.5)))  # room for one copy
    small = place.config()
    assert small is not None
    third = keeper.keep(cat, _saved(ck, 3), small)
    assert third is not None and third.evicted == (second.checkpoint_id,)
    monkeypatch.setenv(place.BUDGET_ENV, str(second.nbytes // 2))
    tiny = place.config()
    assert tiny is not None and keeper.keep(cat, _saved(ck, 4), tiny) is None  # too large to hold
    assert third.directory.is_dir()
    # bytes no row names (another catalog's copy, a ring pass under way) count against the budget too
    (memory_root / "elsewhere").mkdir()
    (memory_root / "elsewhere" / "blob").write_bytes(bytes(second.nbytes))
    assert keeper.keep(cat, _saved(ck, 5), small) is None
    assert third.directory.is_dir() and ring_room.tier_bytes(memory_root) <= 2 * second.nbytes + 4096


@pytest.mark.timeout(300)
def test_a_crashed_job_resumes_from_the_memory_tier_reading_nothing_from_disk(
    prefect_api,
    rewind_env,
    run_name,
    tmp_path,
    memory_root,
):  # type: ignore[no-untyped-def]
    from rewind.flows.training import recover_training, summary

    cat = Catalog()
    cfg = config(tmp_path, run_name, step_time_s=0.3)  # a checkpoint every 10 steps: 3 s apart
    t, result = protect(run_name, cfg)
    ranks_at(run_name, 1)

    def held_at_20() -> int | None:
        steps = [
            s for s, rs in _memory_copies(cat, run_name).items() if any(r.status == "verified" for r in rs)
        ]
        return max(steps) if steps and max(steps) >= 20 else None

    step = wait_until(held_at_20, 120, "a memory copy of step 20", interval=0.05)
    pids = ranks_at(run_name, step)
    os.kill(pids[1], signal.SIGKILL)
    t.join(timeout=120)
    assert result["status"] == "crash", result
    recovered = summary(recover_training(result["incident_id"], return_state=True))
    assert recovered["status"] == "recovered" and recovered["restored_step"] == step, recovered
    inc = incidents.get_incident(cat, result["incident_id"])
    read = inc.details["restore_read_from"]["bytes"]
    assert set(read) == {"memory"} and read["memory"] > 0, read  # nothing read from the disk
    assert (
        tmp_path / "out" / "final.safetensors"
    ).is_file()  # every byte it read was hashed against the catalog's
    assert not any(r for rs in _memory_copies(cat, run_name).values() for r in rs if r.status == "verified")


def test_a_memory_tier_path_that_is_a_link_is_never_written_through(
    rewind_env, run_name, tmp_path, memory_root
):  # type: ignore[no-untyped-def]
    from rewind.infra.errors import ConfigError

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    memory_root.symlink_to(elsewhere)  # /dev/shm is everyone's: a path made first by someone else
    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    _model, ck = _job(run_name, cat, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="not a directory of this user's"):
        keeper.keep(cat, _saved(ck, 1), cfg)
    assert not any(elsewhere.iterdir())
    memory_root.unlink()


def test_an_ended_runs_ring_copy_makes_room_for_the_memory_agent_a_live_runs_never(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    """A multi-host run left its peer-ring copy in this node's memory; another run's copy there is leased (a
    restore reads it); this run's step 1 is held. Step 2 does not fit while the ring's run lives here (it
    holds the run's lock): nothing is let go for it, step 1 stays. Once that run ended, step 2's copy lets
    the ring copy and step 1 go, their rows recorded let go. The budget holds throughout."""
    from rewind.infra.catalog import leases
    from rewind.infra.checkpoint import ring
    from rewind.infra.memory import ring_room

    cat = Catalog()
    cfg = place.config()
    assert cfg is not None
    ids = {}
    for name in ("multihost", "leased"):
        _m, other = _job(f"{run_name}-{name}", cat, tmp_path / name)
        ids[name] = _saved(other, 1)
    _model, ck = _job(run_name, cat, tmp_path / "ckpt")
    step1, step2 = _saved(ck, 1), _saved(ck, 2)
    assert keeper.keep(cat, ids["leased"], cfg) is not None and keeper.keep(cat, step1, cfg) is not None
    size = lineage.get_checkpoint(cat, step1).total_bytes or 0
    ring_copy = ring_room.run_dir(memory_root, f"{run_name}-multihost") / "step-1-0123456789abcdef"
    ring_copy.mkdir(parents=True)
    (ring_copy / "__2_0.distcp").write_bytes(os.urandom(size))
    (ring_copy / "manifest.json").write_bytes(b"")
    passed = ring.Passed(0, size, ring_copy, keeper.mark(cfg), "h2")
    ring.register(cat, ids["multihost"], f"{run_name}-multihost", [passed])
    monkeypatch.setenv(place.BUDGET_ENV, str(int(size * 2.5)))  # the ring's, the leased and one more
    small = place.config()
    assert small is not None
    lease = leases.take(cat, ids["leased"], "a restore reading it")

    live = ring_room.Live(ring_copy.parent)  # its leader lives on this host
    try:
        assert keeper.keep(cat, step2, small) is None  # no room beside what may not go: not held
        assert ring_copy.is_dir()  # never let go for another run's room while its run lives here
        assert [r.status for r in _memory_copies(cat, run_name)[1]] == [R.VERIFIED.value]  # nothing let go
    finally:
        live.close()
    kept = keeper.keep(cat, step2, small)
    assert kept is not None and kept.evicted == (step1,)
    assert not ring_copy.exists() and ring_room.tier_bytes(memory_root) <= small.budget_bytes
    [row] = _memory_copies(cat, f"{run_name}-multihost")[1]
    assert row.status == R.DELETED.value and "room for" in (row.detail or ""), row
    leases.release(cat, lease)


def test_the_memory_agent_copies_only_the_newest_offered_and_nothing_offered_with_its_release(
    rewind_env, run_name, tmp_path, memory_root
):  # type: ignore[no-untyped-def]
    """The supervisor writes each checkpoint it sees committed, then ``release`` when the run finished: ids
    waiting together are one batch (the newest copied), and nothing offered with ``release`` is copied
    after the run's copies are let go."""
    from rewind.infra.memory import agent

    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    _model, ck = _job(run_name, cat, tmp_path / "ckpt")
    ids = [_saved(ck, step) for step in (1, 2, 3)]
    r, w = os.pipe()
    os.write(w, "".join(f"{i}\n" for i in ids).encode())
    with os.fdopen(r, "r") as stream:
        assert next(agent.batches(stream)) == [str(i) for i in ids]  # not one line at a time
        os.write(w, f"{ids[0]}\n{ids[2]}\nrelease\n".encode())
        os.close(w)
        agent.serve(cat, cfg, run_name, stream)  # keeps step 3 (the newest when it starts), then the rest
    held = [r for rs in _memory_copies(cat, run_name).values() for r in rs if r.status != R.DELETED.value]
    assert not held, held
    assert not list(memory_root.rglob("*.safetensors"))


def test_a_step_saved_again_takes_its_memory_copys_place_and_the_older_copys_row_is_let_go(
    rewind_env, run_name, tmp_path, memory_root
):  # type: ignore[no-untyped-def]
    """A replayed timeline saves step 1 again: the new checkpoint's memory copy takes the directory of the
    old one's, whose row must then say it is gone (never naming the new bytes: letting the old checkpoint
    go would delete them)."""
    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    _model, ck = _job(run_name, cat, tmp_path / "ckpt")
    old = _saved(ck, 1)
    assert keeper.keep(cat, old, cfg) is not None
    new = _saved(ck, 1)
    kept = keeper.keep(cat, new, cfg)
    assert kept is not None
    rows = {
        ck_id: [r for r in lineage.replicas_of(cat, ck_id) if r.tier == copies.MEMORY] for ck_id in (old, new)
    }
    assert [r.status for r in rows[old]] == [R.DELETED.value], rows
    assert [r.status for r in rows[new]] == [R.VERIFIED.value] and rows[new][0].uri == str(kept.directory)
    raw = (kept.directory / mf.MANIFEST_NAME).read_bytes()
    assert lineage.get_checkpoint(cat, new).manifest_digest == manifest_digest(raw)


def test_the_default_budget_counts_the_cgroups_memory_limit_where_lower(tmp_path: Path) -> None:
    """A Slurm job's or a pod's memory limit bounds the tier (its pages are charged to the job): the lowest
    limit on the process's cgroup and those above it, in cgroup v2 and v1 alike; none where none is set."""
    v2 = tmp_path / "v2"
    (v2 / "job_7" / "step_0").mkdir(parents=True)
    (v2 / "job_7" / "memory.max").write_text("68719476736\n")  # the job's 64 GiB
    (v2 / "job_7" / "step_0" / "memory.max").write_text("max\n")
    (tmp_path / "self-v2").write_text("0::/job_7/step_0\n")
    assert place.cgroup_limit(tmp_path / "self-v2", v2) == 64 << 30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "pod").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory" / "pod" / "memory.limit_in_bytes").write_text("1073741824\n")
    (tmp_path / "self-v1").write_text("12:cpu,cpuacct:/pod\n4:memory:/pod\n0::/\n")
    assert place.cgroup_limit(tmp_path / "self-v1", v1) == 1 << 30
    (tmp_path / "none").write_text("0::/\n")
    assert place.cgroup_limit(tmp_path / "none", tmp_path / "empty") is None
    assert place.cgroup_limit(tmp_path / "missing", v2) is None


def _leasing_child(checkpoint_id: int) -> subprocess.Popen[str]:
    """Another process of this host holding a restore lease on ``checkpoint_id`` (as a restore reading it
    does), alive until its stdin closes or it is killed."""
    script = (
        "import sys\n"
        "from rewind.infra.catalog import leases\n"
        "from rewind.infra.catalog.db import Catalog\n"
        "leases.take(Catalog(), int(sys.argv[1]))\n"
        "sys.stdin.read()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", script, str(checkpoint_id)], stdin=subprocess.PIPE, text=True
    )


def test_a_restore_killed_while_it_held_a_memory_copy_holds_it_no_more(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    """A job SIGKILLed while it restored from the memory tier never releases its lease. While that process
    lives, its copy is not let go for the next step's (no room: the next step is not held) and retention
    does not delete the checkpoint; once it is gone, without waiting for the lease's expiry (hours), the
    next step's copy takes its room and retention may delete it. Only a holder of this host's boot and pid
    namespace is ever judged gone."""
    from rewind.infra.catalog import leases
    from rewind.infra.catalog.models import Checkpoint
    from rewind.infra.catalog.models import CheckpointStatus as S

    if pids.space() is None:
        pytest.skip("where this process's pids mean something cannot be told here (/proc)")
    cat = Catalog()
    _model, ck = _job(run_name, cat, tmp_path / "ckpt")
    step1, step2 = _saved(ck, 1), _saved(ck, 2)
    cfg = place.config()
    assert cfg is not None
    first = keeper.keep(cat, step1, cfg)
    assert first is not None
    monkeypatch.setenv(place.BUDGET_ENV, str(int(first.nbytes * 1.5)))  # room for one copy
    small = place.config()
    assert small is not None
    with cat.session() as s:  # a newer verified checkpoint: what lets retention delete step 1
        row = s.get(Checkpoint, step2)
        assert row is not None
        row.status = S.VERIFIED.value
    with _leasing_child(step1) as child:
        try:
            wait_until(
                lambda: leases.leased(cat, step1) or child.poll() is not None, 60, "the other process's lease"
            )
            assert child.poll() is None, f"the leasing process ended ({child.returncode})"
            assert keeper.keep(cat, step2, small) is None and first.directory.is_dir()
            assert not leases.delete_guarded(cat, step1, keep_last=1, reason="retention")
        finally:
            child.kill()
            child.wait(timeout=60)
    assert not leases.leased(cat, step1)
    here, space = socket.gethostname(), pids.space()
    assert leases.holder_gone(f"{here}:{child.pid}:{space}:memory-tier")  # a killed memory agent's
    assert not leases.holder_gone(f"{here}:{child.pid}:{space}0")  # another pid namespace's: may live
    assert not leases.holder_gone(f"{here}:{child.pid}")  # where its pid means something unknown
    assert not leases.holder_gone(f"{here}:{os.getpid()}:{space}")  # alive
    kept = keeper.keep(cat, step2, small)
    assert kept is not None and kept.evicted == (step1,) and not first.directory.exists()
    assert leases.delete_guarded(cat, step1, keep_last=1, reason="retention")
    assert lineage.get_checkpoint(cat, step1).status == S.DELETED.value


_HUGE_CHILD = """
import json, os, subprocess, sys
from pathlib import Path
mnt, work, run = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
try:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=256m,mode=0700", "tmpfs", str(mnt)],
                   check=True)
except (OSError, subprocess.CalledProcessError):
    sys.exit(77)  # no tmpfs can be mounted here
os.environ.update({"REWIND_MEMORY_ROOT": str(mnt / "tier"), "REWIND_DIRECT_WRITES": "off"})
import torch
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.format import direct, payload
from rewind.infra.format import manifest as mf
from rewind.infra.memory import keeper, place
from rewind.infra.tiers import fetch

def huge_kb():  # tmpfs bytes in huge pages, this machine's
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("ShmemHugePages:"))
    return int(line.split()[1])

torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights
cat = Catalog()
ck = Checkpointer(run, states={"model": model}, root=work, catalog=cat)
ck.save(1)
direct.BLOCK = fetch.CHUNK = 1 << 20  # the copy written 1 MiB at a time: no write covers a 2 MiB page
before = huge_kb()
fd = os.open(mnt / "control", os.O_WRONLY | os.O_CREAT, 0o600)  # can this machine give huge pages now?
os.ftruncate(fd, 16 << 20)
for _ in range(16):
    os.write(fd, bytes(1 << 20))
os.close(fd)
control_kb = huge_kb() - before
before = huge_kb()
kept = keeper.keep(cat, ck.last_saved.checkpoint_id, place.config())
kept_kb = huge_kb() - before
manifest = mf.read(kept.directory)
states = payload.read_states(kept.directory, manifest, copied=("model",))
entry = next(e for e in manifest.files if e.path == payload.tensor_file("model"))
appended = mnt / "appended"
appended.mkdir()
before = huge_kb()
with open(kept.directory / entry.path, "rb") as src, open(appended / entry.path, "wb") as out:
    while chunk := src.read(1 << 20):  # the same, its length not given first
        out.write(chunk)
appended_kb = huge_kb() - before
print(json.dumps({"control": control_kb, "kept": kept_kb, "appended": appended_kb,
                  "equal": bool(torch.equal(states["model"]["weight"], model.weight.detach()))}))
"""


def _shmem_huge_forced() -> bool:
    """Whether this machine's setting decides shmem huge pages for every tmpfs (``deny``, ``force``)."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    return setting.is_file() and any(f"[{v}]" in setting.read_text() for v in ("deny", "force"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs takes root (in a mount namespace of its own)")
def test_a_memory_copy_on_a_tmpfs_with_huge_pages_is_held_in_huge_pages(rewind_env, run_name, tmp_path):  # type: ignore[no-untyped-def]
    """A node whose memory tier is a tmpfs mounted ``huge=within_size`` (docs/recovery.md): the memory agent
    gives each file of its copy its length before its bytes, so the tmpfs holds it in 2 MiB pages (counted:
    the machine's ``ShmemHugePages``) even when it arrives 1 MiB at a time, and a restore maps it 2 MiB at a
    time; a restore reads the bytes the job saved. The same file written 1 MiB at a time without its length
    is held in 4 KiB pages. Run in a mount namespace of its own: nothing is mounted on this machine."""
    if not Path("/sys/kernel/mm/transparent_hugepage").is_dir() or _shmem_huge_forced():
        pytest.skip("this kernel has no transparent huge pages, or decides them for every tmpfs")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    mnt = tmp_path / "huge"
    mnt.mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _HUGE_CHILD,
         str(mnt), str(tmp_path / "ckpt"), run_name],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    if done.returncode == 77 or (done.returncode and done.stderr.startswith("unshare:")):
        pytest.skip(f"no tmpfs can be mounted here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["equal"], got
    if got["control"] < 14 << 10:  # a file given its length first got none: memory too fragmented now
        pytest.skip(f"this machine gives no huge pages to a tmpfs now: {got}")
    assert got["kept"] >= 14 << 10, got  # the 16 MiB file's whole 2 MiB pages
    assert got["appended"] < 2 << 10, got
