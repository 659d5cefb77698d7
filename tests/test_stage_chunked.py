"""A chunked save hashed in one pass (``stage_chunked``): its chunks (and, where every chunk is expected
new, its packs) hashed right after each copy, on any number of threads, give the files the chunked writer
gives hashing on its own, byte for byte and digest for digest; a pack laid out otherwise than ahead
(chunks repeated, some unchanged) is hashed as it is written; a chunked job's saves hashed in the stall,
in the background and synchronously are the same files; values changed after ``save()`` returned never
reach the checkpoint; a frozen backbone's saves link what did not change and restore bit-exact."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint import stage_chunked, stall_hash
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.checkpoint.staging import StagingBuffer
from rewind.infra.format import chunked, digest, packs, payload, store, verify
from rewind.infra.format import manifest as mf

ROW_SIZES = [1, 7, 1000, chunked.CHUNK_BYTES // 4 + 3, chunked.CHUNK_BYTES + 5]  # elements of 4 bytes a row


def _parts(rnd: random.Random, *, repeats: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Tensors of several dtypes and row sizes (rows over a chunk, empty ones), about 3 packs in all, and
    small chunks that repeat (an optimizer's ``step`` per parameter); with ``repeats``, larger chunks of
    zeros that repeat too (stored once: the packs after the first such are then not the ones expected)."""
    parts: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}}
    total = 0
    i = 0
    while total < 3 * packs.PACK_BYTES:
        row = rnd.choice(ROW_SIZES)
        rows = rnd.randrange(1, max(2, 8 * chunked.CHUNK_BYTES // (4 * row)))
        dtype = rnd.choice([torch.float32, torch.int32])
        t = torch.randint(-1000, 1000, (rows, row), dtype=torch.int32).to(dtype)
        if repeats and i % 3 == 0:
            t.zero_()
        parts[rnd.choice(["model", "optimizer"])][f"t{i:03d}"] = t
        total += t.numel() * 4
        i += 1
    parts["model"]["empty"] = torch.empty(0, 5)
    parts["optimizer"].update({f"state.{i}.step": torch.tensor(3.0) for i in range(20)})
    if repeats:
        parts["model"].update(zeros_a=torch.zeros(16384), zeros_b=torch.zeros(16384))  # 64 KiB each
    return parts


def _streamed(fill: store.FileWriter) -> bytes:
    out = io.BytesIO()
    fill(out)
    return out.getvalue()


def _files(parts: dict[str, dict[str, torch.Tensor]], pre: payload.Prehashed | None) -> dict[str, object]:
    return dict(payload.file_writers({}, parts, fmt=payload.CHUNKED, prehashed=pre))


@pytest.mark.parametrize("workers", [1, 2, 5])
@pytest.mark.parametrize("repeats", [False, True])
def test_one_pass_hashes_chunks_and_packs_as_the_chunked_writer_would(workers, repeats):
    seed = random.randrange(1 << 30)
    parts = _parts(random.Random(seed), repeats=repeats)
    staged, pre = stage_chunked.stage_and_hash(StagingBuffer(), parts, workers=workers, all_new=True)
    for p, tensors in parts.items():
        assert all(torch.equal(staged.parts[p][k], t) for k, t in tensors.items()), (seed, p)
    alone = _files(parts, None)  # the chunked writer hashing every chunk itself, from the job's tensors
    ahead = _files(staged.parts, pre)
    assert list(ahead) == list(alone), seed  # the same packs, named by the same chunks, and the index
    for name, fill in ahead.items():
        data = _streamed(fill.fill if isinstance(fill, store.Hashed) else fill)  # type: ignore[union-attr,arg-type]
        assert data == _streamed(alone[name]), (seed, name)  # type: ignore[arg-type]
        if isinstance(fill, store.Hashed):
            assert fill.digest == digest.hash_bytes(data), (seed, name)
    hashed_ahead = {n for n, f in ahead.items() if isinstance(f, store.Hashed)}
    every_pack = {n for n in ahead if n.startswith(packs.PACK_DIR + "/")}
    if not repeats:  # laid out as expected (the small repeats found): no pack hashed again as it is written
        assert hashed_ahead == every_pack, seed
    else:  # a pack without the zeros stored once is not the one hashed ahead: hashed as it is written
        assert hashed_ahead < every_pack, seed


def test_with_most_chunks_expected_unchanged_only_the_chunks_are_hashed_ahead():
    parts = _parts(random.Random(7), repeats=False)
    staged, pre = stage_chunked.stage_and_hash(StagingBuffer(), parts, workers=2, all_new=False)
    assert pre.files == {}
    index, _chunks = chunked.build_index(parts)
    refs = {
        (part, name, a): d
        for part, ts in index["states"].items()
        for name, info in ts.items()
        for d, a, _b in info["chunks"]
    }
    assert dict(pre.chunks) == refs
    assert chunked.build_index(staged.parts, pre.chunks)[0] == index


def test_a_state_a_copy_of_bytes_does_not_stage_is_staged_and_its_chunks_hashed_all_the_same():
    base = torch.randn(600, 700)
    parts = {
        "model": {"transposed": base.t(), "w": torch.randn(1000)},
        "optimizer": {"m": torch.randn(70_000)},
    }
    staged, pre = stage_chunked.stage_and_hash(StagingBuffer(), parts, workers=2, all_new=True)
    for p, tensors in parts.items():
        assert all(torch.equal(staged.parts[p][k], t) for k, t in tensors.items()), p
    assert chunked.build_index(staged.parts, pre.chunks)[0] == chunked.build_index(parts)[0]
    assert _files(staged.parts, pre).keys() == _files(parts, None).keys()


def _job(run: str, cat: Catalog, root: Path, mode: SaveMode):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(2048, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(
        run,
        states={"model": model, "optimizer": opt},
        root=root,
        catalog=cat,
        mode=mode,
        format=payload.CHUNKED,
    )
    return model, opt, ck


def _step(model, opt) -> None:  # type: ignore[no-untyped-def]
    model(torch.arange(0, 2048, 16).view(8, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _saves(cat: Catalog, run: str) -> list[tuple[mf.FileEntry, ...]]:
    return [mf.read(Path(c.path)).files for c in lineage.checkpoints(cat, run)]


def test_chunked_saves_hashed_in_the_stall_in_the_background_or_synchronously_are_the_same_files(
    rewind_env, run_name, tmp_path, monkeypatch
):
    """Two saves of full training (packs hashed ahead), then the embedding frozen: the third save carries
    its unchanged chunks into a pack of their own, the fourth links that pack, and the fifth, after a save
    that wrote under half its bytes, hashes only its chunks ahead."""
    cat = Catalog()
    saved = {}
    written_as_hashed: list[str] = []
    real = store.write_file

    def spy(path: Path, fill: store.FileWriter | store.Hashed, **kw: int) -> mf.FileEntry:
        if isinstance(fill, store.Hashed):
            written_as_hashed.append(path.parent.name)
        return real(path, fill, **kw)

    monkeypatch.setattr(store, "write_file", spy)
    for label, mode, setting in [("sync", SaveMode.SYNC, "off"), ("bg", SaveMode.ASYNC, "off"),
                                 ("stall", SaveMode.ASYNC, "on")]:  # fmt: skip
        monkeypatch.setenv(stall_hash.ENV, setting)
        run = f"{run_name}-{label}"
        model, opt, ck = _job(run, cat, tmp_path / "ckpt", mode)
        for step in (1, 2, 3, 4, 5):
            if step == 3:
                model[0].weight.requires_grad_(False)
                opt.state.pop(model[0].weight)
            _step(model, opt)
            ck.save(step)
        ck.close()
        saved[label] = _saves(cat, run)
        assert written_as_hashed.count(packs.PACK_DIR) >= 2, label  # the first two saves' packs at least
        written_as_hashed.clear()
        done = lineage.checkpoints(cat, run)
        assert [c.step for c in done] == [1, 2, 3, 4, 5]
        for c in done:
            assert verify.check_copy(Path(c.path), c.manifest_digest, deep=True).findings == (), (
                label,
                c.step,
            )
        assert ck.last_saved is not None and ck.last_saved.linked_bytes > ck.last_saved.written_bytes
        fresh, _, other = _job(run, cat, tmp_path / "ckpt", SaveMode.SYNC)
        assert other.restore_latest() is not None
        other.close()
        assert all(
            torch.equal(a, b)
            for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
        )
    assert saved["stall"] == saved["bg"] == saved["sync"]  # path, size, xxh3 and crc32c of every file


def test_values_changed_after_a_chunked_save_returned_never_reach_the_checkpoint(
    rewind_env, run_name, tmp_path, monkeypatch
):
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
    fresh, _, other = _job(run_name, cat, tmp_path / "ckpt", SaveMode.SYNC)
    done = other.restore_latest()
    other.close()
    assert done is not None and done.step == 2
    assert all(torch.equal(v, at_call[2][k]) for k, v in fresh.state_dict().items())
