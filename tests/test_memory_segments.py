"""A memory copy's files are proven a segment per core against the digests the catalog recorded with it."""

from __future__ import annotations

import json
import os
import random
import threading

import pytest
import torch
import xxhash
from sqlalchemy import update

from rewind.infra.catalog import copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Replica
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import manifest as mf
from rewind.infra.format import mapped, segments
from rewind.infra.format.digest import Hasher, hash_bytes
from rewind.infra.memory import keeper, place
from tests.test_memory_tier import _helpers_refused_after, _memory_copies

SEGMENT = 1 << 20  # the tests' segment: a 4 MiB model is 5 of them, the last a part one


def test_segment_digests_are_each_segments_xxh3_however_the_bytes_arrive() -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for size in (0, 1, SEGMENT, 3 * SEGMENT, 3 * SEGMENT + 12345):
        data = os.urandom(size)
        h = Hasher(segment=SEGMENT)
        at = 0
        while at < size:  # pieces of any size, across segment ends and the cache-sized pieces inside
            n = rng.choice((1, 4095, 256 << 10, SEGMENT - 1, SEGMENT + 7, 3 << 20))
            h.update(data[at : at + n])
            at += n
        got = h.result()
        want = tuple(xxhash.xxh3_128(data[i : i + SEGMENT]).hexdigest() for i in range(0, size, SEGMENT))
        assert got.segments == want and len(want) == -(-size // SEGMENT), f"size {size}, seed {seed}"
        assert (got.xxh3, got.crc32c) == (hash_bytes(data).xxh3, hash_bytes(data).crc32c), f"seed {seed}"


@pytest.fixture
def kept(rewind_env, run_name, tmp_path, memory_root, monkeypatch):  # type: ignore[no-untyped-def]
    """A 4 MiB model saved and copied into the memory tier with 1 MiB segments; (catalog, model, memory row)."""
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    cat, cfg = Catalog(), place.config()
    assert cfg is not None
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    ck = Checkpointer(run_name, states={"model": model}, root=tmp_path / "ckpt", catalog=cat)
    ck.save(1)
    assert ck.last_saved is not None
    done = keeper.keep(cat, ck.last_saved.checkpoint_id, cfg)
    assert done is not None
    [row] = _memory_copies(cat, run_name)[1]
    return cat, model, row, done.directory, copies.segments_of(cat, row.id, segments.MAX_RECORD)


def _restored(cat: Catalog, run: str, root: object, model: torch.nn.Module) -> tuple[str, bool]:
    torch.manual_seed(5)
    fresh = torch.nn.Linear(1024, 1024)
    got = Checkpointer(run, states={"model": fresh}, root=root, catalog=cat).restore_latest()  # type: ignore[arg-type]
    assert got is not None and got.step == 1
    same = all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )
    return got.source, same


def _set_record(cat: Catalog, replica_id: int, record: str | None) -> None:
    with cat.session() as s:
        s.execute(update(Replica).where(Replica.id == replica_id).values(segments=record))


def test_a_memory_copy_proves_each_segment_against_the_catalogs_record(kept, run_name, tmp_path):  # type: ignore[no-untyped-def]
    """The agent records each file's segment digests with the copy; a restore from memory holds every segment
    to them (bit-exact when they match). A record that differs from the bytes refuses the copy even though
    the file matches its manifest entry: the segments, not a second whole-file pass, are what is checked."""
    cat, model, row, directory, recorded = kept
    record = json.loads(recorded)
    data = (directory / "model.safetensors").read_bytes()
    assert record["segment"] == SEGMENT
    assert record["files"]["model.safetensors"] == [
        xxhash.xxh3_128(data[i : i + SEGMENT]).hexdigest() for i in range(0, len(data), SEGMENT)
    ]
    assert len(record["files"]["model.safetensors"]) == 5
    assert _restored(cat, run_name, tmp_path / "ckpt", model) == ("memory", True)
    manifest = mf.read(directory)  # what a spread restore compares with each disk's copy's manifest
    with_segments = segments.attach(manifest, recorded)
    assert with_segments.files[0].segments and with_segments == manifest
    assert with_segments.files[0].segments[0] not in repr(with_segments)  # never in a message

    wrong = dict(record, files={"model.safetensors": [*record["files"]["model.safetensors"][:-1], "0" * 32]})
    _set_record(cat, row.id, json.dumps(wrong))
    assert _restored(cat, run_name, tmp_path / "ckpt", model) == ("local", True)
    [after] = _memory_copies(cat, run_name)[1]
    assert after.status == R.CORRUPT.value and "segment 4" in (after.detail or "")


def test_a_damaged_segment_is_refused_and_a_record_that_does_not_fit_hashes_the_file_whole(
    kept, run_name, tmp_path
):  # type: ignore[no-untyped-def]
    cat, model, row, directory, recorded = kept
    digests = json.loads(recorded)["files"]["model.safetensors"]
    newline = json.dumps(
        {"segment": SEGMENT, "files": {"model.safetensors": [digests[0] + "\n", *digests[1:]]}}
    )
    for record in (
        None,
        "{",
        json.dumps({"segment": 12345, "files": {}}),
        recorded.replace('"', "'"),
        newline,
    ):
        _set_record(cat, row.id, record)  # none, malformed, another size: each file hashed whole
        assert _restored(cat, run_name, tmp_path / "ckpt", model) == ("memory", True), record
    _set_record(cat, row.id, recorded)
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[2 * SEGMENT + 77] ^= 0x10
    path.unlink()  # never written in place: replaced
    path.write_bytes(bytes(data))
    assert _restored(cat, run_name, tmp_path / "ckpt", model) == ("local", True)
    [after] = _memory_copies(cat, run_name)[1]
    assert after.status == R.CORRUPT.value and "segment 2" in (after.detail or ""), after.detail


def test_segments_are_hashed_on_this_thread_where_no_worker_can_start(memory_root, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(segments, "SEGMENT", SEGMENT)
    data = os.urandom(3 * SEGMENT + 5)
    d = hash_bytes(data)
    parts = tuple(xxhash.xxh3_128(data[i : i + SEGMENT]).hexdigest() for i in range(0, len(data), SEGMENT))
    memory_root.mkdir(parents=True)
    (memory_root / "x.bin").write_bytes(data)
    real_start = threading.Thread.start
    for started in (0, 1):
        start = _helpers_refused_after(started, real_start, prefix="rewind-segment")
        monkeypatch.setattr(threading.Thread, "start", start)
        view = mapped.verified_mapping(memory_root, mf.FileEntry("x.bin", d.size, d.xxh3, "", parts))
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert view is not None and view == data, started
        bad = mf.FileEntry("x.bin", d.size, d.xxh3, "", (*parts[:3], parts[0]))
        with pytest.raises(CorruptCheckpoint, match="segment 3"):
            mapped.verified_mapping(memory_root, bad)


def test_only_memory_copies_carry_segment_digests(kept, run_name):  # type: ignore[no-untyped-def]
    cat = kept[0]
    rows = [r for reps in copies.copies_of(cat, [kept[2].checkpoint_id]).values() for r in reps]
    recorded = {r.tier: copies.segments_of(cat, r.id, segments.MAX_RECORD) is not None for r in rows}
    assert recorded == {"local": False, "memory": True}
    keeper.remove(kept[3])
    copies.record(cat, kept[2].id, R.DELETED, "let go")  # as the keeper lets a copy go
    assert copies.segments_of(cat, kept[2].id, segments.MAX_RECORD) is None
