"""A module restored from a memory copy is loaded in place, a segment at a time, each only once it is proven."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rewind.infra.catalog import copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import own_tensors
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.errors import CorruptCheckpoint, NoRestorableCheckpoint
from rewind.infra.format import manifest as mf
from rewind.infra.format import mapped, segments, tensorfile
from rewind.infra.memory import keeper, place
from tests.test_memory_tier import _mapped_from, _memory_copies, _saved

SEGMENT = 1 << 20  # a 4 MiB Linear(1024, 1024) is 5 segments, the last a part one
SENTINEL = 0xA5


def _kept(run: str, root: Path, model: torch.nn.Module) -> tuple[Catalog, Path]:
    """``model`` saved at step 1 and copied into the memory tier; (catalog, the memory copy's directory)."""
    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    ck = Checkpointer(run, states={"model": model}, root=root, catalog=cat)
    done = keeper.keep(cat, _saved(ck, 1), cfg)
    assert done is not None
    ck.close()
    return cat, done.directory


def _damage(path: Path, at: int) -> None:
    """One byte of a checkpoint file changed; the file replaced, as no checkpoint file is written in place."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.unlink()
    path.write_bytes(bytes(data))


def _entry(cat: Catalog, run: str, directory: Path) -> mf.FileEntry:
    """The memory copy's model file as a restore holds it: its manifest entry with the catalog's segments."""
    [row] = next(iter(_memory_copies(cat, run).values()))
    manifest = segments.attach(mf.read(directory), copies.segments_of(cat, row.id, segments.MAX_RECORD))
    [entry] = [e for e in manifest.files if e.path == "model.safetensors"]
    assert len(entry.segments) == 5
    return entry


def test_no_byte_of_a_segment_that_fails_reaches_the_module(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    """Each segment's bytes are copied into the module's tensors only once that segment matched the
    catalog's digest: with segment 2 damaged, none of its bytes are in them, and every byte that is came
    from a proven segment. Undamaged, the tensors hold the checkpoint bit-exact and nothing stays mapped."""
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    model = torch.nn.Linear(1024, 1024)
    cat, directory = _kept(run_name, tmp_path / "ckpt", model)
    entry = _entry(cat, run_name, directory)
    path = directory / "model.safetensors"
    saved = path.read_bytes()
    into = {"model.weight": torch.empty(1024, 1024), "model.bias": torch.empty(1024)}
    assert mapped.verified_into(directory, entry, into)
    assert torch.equal(into["model.weight"], model.weight) and torch.equal(into["model.bias"], model.bias)

    _damage(path, 2 * SEGMENT + 4321)
    for t in into.values():
        t.view(torch.uint8).fill_(SENTINEL)
    with pytest.raises(CorruptCheckpoint, match="segment 2"):
        mapped.verified_into(directory, entry, into)
    weight = into["model.weight"].view(torch.uint8).reshape(-1)
    start = saved.index(model.weight.detach().numpy().tobytes()[:64])  # where the weight lies in the file
    lo, hi = 2 * SEGMENT - start, 3 * SEGMENT - start  # segment 2, within the weight
    assert bool((weight[lo:hi] == SENTINEL).all()), f"seed {seed}"
    proven = torch.frombuffer(bytearray(saved[start : start + weight.numel()]), dtype=torch.uint8)
    assert bool(((weight == SENTINEL) | (weight == proven)).all()), f"seed {seed}"
    assert _mapped_from(memory_root) == []


def test_a_module_restored_from_memory_keeps_its_tensors_and_its_optimizer(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    """A restore from memory writes into the module's own parameters (the same objects, at the same
    addresses, marked written), so an optimizer made before it still steps them."""
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    torch.manual_seed(3)
    model = torch.nn.Linear(1024, 1024)
    cat, _ = _kept(run_name, tmp_path / "ckpt", model)
    fresh = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(fresh.parameters(), lr=0.5)
    where, version = fresh.weight.data_ptr(), fresh.weight._version
    loads, in_place = mapped.verified_into, []
    monkeypatch.setattr(mapped, "verified_into", lambda *a: in_place.append(loads(*a)) or in_place[-1])
    ck = Checkpointer(run_name, states={"model": fresh}, root=tmp_path / "ckpt", catalog=cat)
    got = ck.restore_latest()
    assert got is not None and got.source == "memory" and in_place == [True]
    assert fresh.weight.data_ptr() == where and fresh.weight._version > version
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    fresh(torch.ones(1, 1024)).sum().backward()
    opt.step()
    assert torch.equal(fresh.weight, model.weight - 0.5)  # d(sum)/dW is all ones
    ck.close()


@pytest.mark.parametrize("flat", ["allocated", "from_numpy"])
def test_a_rollback_in_the_process_that_saved_keeps_parameters_over_one_flat_buffer(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch, flat
):  # type: ignore[no-untyped-def]
    """Parameters that are views of one flat buffer (as a fused optimizer or a bucketed all-reduce keeps
    them), saved and then rolled back from memory by the same checkpointer, are loaded into that buffer
    and stay its views: none is given a copy of its own. Its storage is not resizable when made by
    ``torch.from_numpy``; a save must not make it so."""
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    torch.manual_seed(8)
    n = 1024 * 1024 + 1024
    buffer = torch.zeros(n) if flat == "allocated" else torch.from_numpy(np.zeros(n, dtype=np.float32))
    buffer.copy_(torch.randn(n))
    model = torch.nn.Linear(1024, 1024)
    model.weight = torch.nn.Parameter(buffer[: 1024 * 1024].view(1024, 1024))
    model.bias = torch.nn.Parameter(buffer[1024 * 1024 :])
    saved = buffer.clone()
    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    ck = Checkpointer(run_name, states={"model": model}, root=tmp_path / "ckpt", catalog=cat)
    assert keeper.keep(cat, _saved(ck, 1), cfg) is not None
    buffer.add_(1.0)  # a step taken after the save, e.g. one that went bad
    got = ck.restore_latest()
    assert got is not None and got.source == "memory"
    assert model.weight.data_ptr() == buffer.data_ptr()
    assert model.bias.data_ptr() == buffer.data_ptr() + 4 * 1024 * 1024
    assert torch.equal(buffer, saved)
    ck.close()


def test_a_module_saved_with_a_layout_is_still_loaded_in_place(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    """A channels-last 1x1 convolution's weight is saved with its layout (its size-1 dimensions' strides are
    not row-major's) and an expanded buffer without one; restored from memory, the module is still loaded
    in place, bit-exact, its weight keeping its strides."""
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    torch.manual_seed(9)

    def module() -> torch.nn.Module:
        m = torch.nn.Conv2d(1024, 1024, 1).to(memory_format=torch.channels_last)
        m.register_buffer("pos", torch.arange(1024.0).expand(1, -1))
        return m

    model = module()
    cat, directory = _kept(run_name, tmp_path / "ckpt", model)
    assert "__strided__" in (directory / "state.json").read_text()
    fresh = module()
    with torch.no_grad():
        fresh.weight.zero_()
    strides = fresh.weight.stride()
    loads, in_place = mapped.verified_into, []
    monkeypatch.setattr(mapped, "verified_into", lambda *a: in_place.append(loads(*a)) or in_place[-1])
    ck = Checkpointer(run_name, states={"model": fresh}, root=tmp_path / "ckpt", catalog=cat)
    got = ck.restore_latest()
    assert got is not None and got.source == "memory" and in_place == [True]
    assert torch.equal(fresh.weight, model.weight) and fresh.weight.stride() == strides
    assert torch.equal(fresh.pos, model.pos)
    ck.close()


def test_a_module_whose_tensors_do_not_fit_is_loaded_by_torch_from_the_proven_mapping(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    """A module of another dtype than the checkpoint's is not written in place: torch's load converts."""
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    torch.manual_seed(4)
    model = torch.nn.Linear(1024, 1024)
    cat, _ = _kept(run_name, tmp_path / "ckpt", model)
    half = torch.nn.Linear(1024, 1024).to(torch.bfloat16)
    ck = Checkpointer(run_name, states={"model": half}, root=tmp_path / "ckpt", catalog=cat)
    got = ck.restore_latest()
    assert got is not None and got.source == "memory"
    assert torch.equal(half.weight, model.weight.to(torch.bfloat16))
    ck.close()


def test_a_header_over_two_segments_is_proven_before_it_is_read(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    """1000 tensors make a header longer than a 64 KiB segment: loaded in place bit-exact; with a byte of
    the header's second segment damaged the memory copy is refused, not the checkpoint condemned."""
    monkeypatch.setattr(segments, "SEGMENT", 64 << 10)
    torch.manual_seed(6)
    model = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.randn(1024)) for i in range(1000)})
    cat, directory = _kept(run_name, tmp_path / "ckpt", model)
    path = directory / "model.safetensors"
    assert int.from_bytes(path.read_bytes()[:8], "little") > 64 << 10
    parsed: list[int] = []  # headers parsed from a mapping
    laid_out = tensorfile.laid_out
    monkeypatch.setattr(tensorfile, "laid_out", lambda view: (parsed.append(1), laid_out(view))[1])

    def restored() -> str:
        fresh = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.zeros(1024)) for i in range(1000)})
        where = fresh["p7"].data_ptr()
        ck = Checkpointer(run_name, states={"model": fresh}, root=tmp_path / "ckpt", catalog=cat)
        got = ck.restore_latest()
        ck.close()
        assert got is not None and all(torch.equal(fresh[k], model[k]) for k in model)
        assert fresh["p7"].data_ptr() == where
        return got.source

    assert restored() == "memory" and parsed
    parsed.clear()
    _damage(path, (64 << 10) + 100)  # inside the header's second segment
    assert restored() == "local" and not parsed  # refused before the header was read


@pytest.mark.parametrize("segment", [0, 3])
def test_a_restore_that_wrote_in_place_and_then_found_nothing_never_starts_from_scratch(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch, segment
):  # type: ignore[no-untyped-def]
    """Segment 3 of the memory copy damaged after segments 0 to 2 may be in the module, and the local copy
    damaged too: the restore raises rather than hand back a module holding part of a checkpoint as a fresh
    start. Segment 0 damaged (refused before any byte was copied): a fresh start, as without a memory
    copy. A new process, which no longer tries the refused memory copy, starts from scratch."""
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    torch.manual_seed(8)
    model = torch.nn.Linear(1024, 1024)
    cat, directory = _kept(run_name, tmp_path / "ckpt", model)
    _damage(directory / "model.safetensors", segment * SEGMENT + 99)
    [local] = [p for p in (tmp_path / "ckpt").rglob("model.safetensors") if memory_root not in p.parents]
    _damage(local, 3 * SEGMENT + 99)
    fresh = torch.nn.Linear(1024, 1024)
    initial = fresh.weight.detach().clone()
    ck = Checkpointer(run_name, states={"model": fresh}, root=tmp_path / "ckpt", catalog=cat)
    if segment:
        with pytest.raises(NoRestorableCheckpoint, match="wrote into a module"):
            ck.restore_latest()
    else:
        assert ck.restore_latest() is None and torch.equal(fresh.weight, initial)
    ck.close()
    ck = Checkpointer(
        run_name, states={"model": torch.nn.Linear(1024, 1024)}, root=tmp_path / "ckpt", catalog=cat
    )
    assert ck.restore_latest() is None
    ck.close()


class _Tied(torch.nn.Module):
    """Two linears, ``a``'s weight ``b``'s (an LM head tied to its embedding). ``b`` comes first in the
    state dict and ``a`` first in the file (its tensors are ordered by name), so the key torch's load
    copies last (``a.weight``) is the one the file holds first."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Linear(1024, 512)
        self.a = torch.nn.Linear(1024, 512)
        self.a.weight = self.b.weight


def test_tied_weights_take_the_last_keys_bytes_as_torchs_load_leaves_them(
    rewind_env, run_name, tmp_path, memory_root, monkeypatch
):  # type: ignore[no-untyped-def]
    """A checkpoint of two untied weights restored from memory into a module that ties them holds what
    torch's own load leaves (the later key's bytes), not a mix of both."""
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    torch.manual_seed(9)
    untied = _Tied()
    untied.a.weight = torch.nn.Parameter(torch.randn(512, 1024))
    cat, _ = _kept(run_name, tmp_path / "ckpt", untied)
    want = _Tied()
    want.load_state_dict(untied.state_dict())  # torch's own load, from tensors of their own
    tied = _Tied()
    loads, in_place = mapped.verified_into, []
    monkeypatch.setattr(mapped, "verified_into", lambda *a: in_place.append(loads(*a)) or in_place[-1])
    ck = Checkpointer(run_name, states={"model": tied}, root=tmp_path / "ckpt", catalog=cat)
    got = ck.restore_latest()
    ck.close()
    assert got is not None and got.source == "memory" and in_place == [True]
    assert list(tied.state_dict())[-2:] == ["a.weight", "a.bias"]
    assert tied.a.weight is tied.b.weight and torch.equal(tied.a.weight, untied.a.weight)
    assert all(
        torch.equal(a, b) for a, b in zip(tied.state_dict().values(), want.state_dict().values(), strict=True)
    )


def test_tensors_whose_bytes_are_not_their_values_are_never_written_in_place() -> None:
    """A lazily conjugated or negated tensor (a copy resolves the flag, a byte copy would not) or an
    inference tensor (torch refuses to write it) makes a module load the usual way."""
    plain = torch.nn.Linear(4, 4)
    assert set(own_tensors.targets(plain)) == {"weight", "bias"}
    conj = torch.nn.Linear(4, 4)
    conj.register_buffer("rope", torch.polar(torch.ones(4), torch.arange(4.0)).conj())
    neg = torch.nn.Linear(4, 4)
    neg.register_buffer("flip", torch._neg_view(torch.randn(4)))
    with torch.inference_mode():
        frozen = torch.nn.Linear(4, 4)
    assert neg.flip.is_neg() and neg.flip.is_contiguous() and conj.rope.is_contiguous()
    assert [own_tensors.targets(m) for m in (conj, neg, frozen)] == [{}, {}, {}]
