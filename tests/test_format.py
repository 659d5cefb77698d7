"""The checkpoint format: state trees, tensor files, manifests, and the data position."""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rewind.infra.checkpoint.state import RNGState
from rewind.infra.errors import ConfigError, MalformedFile
from rewind.infra.format import keyring as kr
from rewind.infra.format import manifest as mf
from rewind.infra.format import tensorfile, tree
from rewind.infra.format.digest import Hasher, HashingReader, HashingWriter
from rewind.infra.training.data import ResumableLoader


def test_tree_round_trip_keeps_types_and_bits():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = {
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": RNGState().state_dict(),
        "odd": {1: (b"\x00\xff", float("inf"), None), "__tensor__": [np.arange(3, dtype=np.uint32)]},
    }
    j, tensors = tree.split(state, "s")
    back = tree.join(j, tensors)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
    assert set(back["optimizer"]["state"]) == {0, 1}
    for k in (0, 1):
        for name, t in opt.state_dict()["state"][k].items():
            assert torch.equal(back["optimizer"]["state"][k][name], t)
    assert back["scaler"] == scaler.state_dict()
    assert back["odd"][1] == (b"\x00\xff", float("inf"), None)
    assert np.array_equal(back["odd"]["__tensor__"][0], np.arange(3, dtype=np.uint32))

    # The restored states draw what the captured ones draw: each in a generator of its own (the module-wide
    # ones are shared with any thread a test left running, which could draw between capture and check).
    def draws(rng: dict[str, Any]) -> tuple[float, float, torch.Tensor]:
        py, npr, tg = random.Random(), np.random.RandomState(), torch.Generator()
        py.setstate(rng["python"])
        npr.set_state(rng["numpy"])
        tg.set_state(rng["torch"])
        return py.random(), npr.rand(), torch.rand(1, generator=tg)

    got, expected = draws(back["rng"]), draws(state["rng"])
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_tree_keeps_bytesio_values_as_torchtitan_train_state_holds_them():
    """TorchTitan's TrainState returns its loss history as io.BytesIO: kept (bytes and position) through JSON."""
    import io

    history = io.BytesIO()
    torch.save([2.5, 2.25], history)
    at = history.tell()
    j, tensors = tree.split({"train_state": {"step": 3, "global_avg_losses": history}}, "s")
    back = tree.join(json.loads(json.dumps(j)), tensors)["train_state"]["global_avg_losses"]
    assert isinstance(back, io.BytesIO) and back.tell() == at and back.getvalue() == history.getvalue()
    back.seek(0)
    assert torch.load(back, weights_only=True) == [2.5, 2.25]


def test_tree_keeps_numpy_dtypes_shapes_and_key_order_through_json():
    """An np.float32 EMA stays float32 (NumPy 2 would promote a Python float: no bit-exact resume), a 0-d
    array stays 0-d, and a dict's keys come back in the order the job had them ("step_10" after "step_9")."""
    state = {"ema": np.float32(0.1), "count": np.int64(7), "scale": np.array(3.0), "step_9": 1, "step_10": 2}
    j, tensors = tree.split(state, "s")
    back = tree.join(json.loads(json.dumps(j)), tensors)
    assert list(back) == list(state)
    for k in ("ema", "count", "scale"):
        assert type(back[k]) is type(state[k]) and back[k].dtype == state[k].dtype
        assert np.shape(back[k]) == np.shape(state[k]) and back[k] == state[k]


@pytest.mark.parametrize(
    "value",
    [
        np.array(["a", "bb", None], dtype=object),  # pandas .values of a string column
        np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
        np.ma.masked_array([1, 2], mask=[0, 1]),
    ],
    ids=["object", "structured", "masked"],
)
def test_tree_refuses_numpy_values_whose_bytes_are_not_their_values(value):
    """Saved, an object array's bytes are pointers: every checkpoint of it would be refused at load and the
    job would start over. Refused at save, in one line naming where."""
    with pytest.raises(ConfigError, match=r"at 's\.extra\.x'"):
        tree.split({"extra": {"x": value}}, "s")


@pytest.mark.parametrize(
    "state", [{"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, {1: torch.ones(1), "1": torch.zeros(1)}]
)
def test_tree_refuses_two_tensors_of_one_name(state):
    """Both would be saved under one name and one of them would come back as the other."""
    with pytest.raises(ConfigError, match="both named"):
        tree.split(state, "s")


def test_tree_refuses_unknown_objects():
    with pytest.raises(ConfigError, match=r"at 'x.bad'"):
        tree.split({"bad": object()}, "x")


def test_tensorfile_is_plain_safetensors_and_aligned(tmp_path):
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.float64),
        "b": torch.arange(7, dtype=torch.int8),
        "c": torch.randn(2, 3).to(torch.bfloat16),
        "d": torch.tensor(3.5),
        "e": torch.empty(0, 4),
        "f": torch.randn(4, 4).t(),  # non-contiguous
    }
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as raw:
        w = HashingWriter(raw)
        tensorfile.write(w, tensors)
    assert w.hasher.result().size == path.stat().st_size
    other = load_file(str(path))  # the reference implementation reads our files
    with open(path, "rb") as f:
        reader = HashingReader(f, Hasher())
        ours, _ = tensorfile.read(reader, path.stat().st_size)
    assert reader.hasher.result() == w.hasher.result()  # every byte went through the hasher once
    storages = set()
    for k, t in tensors.items():
        assert torch.equal(other[k], t) and torch.equal(ours[k], t) and ours[k].dtype == t.dtype
        assert ours[k].storage_offset() == 0  # its own storage, not a view into a shared buffer
        storages.add(ours[k].untyped_storage().data_ptr())
    assert (
        len(storages) == len([t for t in tensors.values() if t.numel()]) + 1
    )  # one per tensor (empties share 0)


def _read_bytes(raw: bytes, how: str = "read"):  # type: ignore[no-untyped-def]
    import io

    if how == "over":  # a whole file in memory (a mapping), tensors made over its bytes
        return tensorfile.over(memoryview(bytearray(raw)))
    return tensorfile.read(HashingReader(io.BytesIO(raw), Hasher()), len(raw))


def _file(header: object, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def _span(dtype: str, shape: list[int], start: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"\xff" * 8 + b"{}", "is over"),
        ((64).to_bytes(8, "little") + b"{}", "runs past"),
        (_file([], b""), "not a JSON object"),
        (_file({"a": _span("F32", [4], 0, 16)}, b"\x00" * 8), "do not fit"),
        (_file({"a": _span("F32", [3], 0, 16)}, b"\x00" * 16), "do not fit"),
        (_file({"a": _span("U8", [4], 0, 4), "b": _span("U8", [4], 2, 6)}, b"\x00" * 6), "overlap"),
        (_file({"a": _span("PICKLE", [1], 0, 1)}, b"\x00"), "unsupported dtype"),
        (_file({"a": _span("F32", [0, 2**62, 2**62], 0, 0)}, b""), "malformed shape"),  # empty, unallocatable
        (_file({"a": {"dtype": "F32", "shape": [float("inf")], "data_offsets": [0, 0]}}, b""), "malformed"),
        # what Hugging Face's reader refuses too: a dtype, shape or offsets of another JSON type
        (_file({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 4), "unsupported"),
        (_file({"a": {"dtype": "F32", "shape": {"1": 1}, "data_offsets": [0, 4]}}, b"\x00" * 4), "malformed"),
        (_file({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\x00" * 4), "malformed"),
        (_file({"a": {"dtype": "F32", "shape": [1.9], "data_offsets": [0, 4]}}, b"\x00" * 4), "malformed"),
        (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": "04"}}, b"\x00" * 4), "malformed"),
        (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, b"\x00" * 8), "malformed"),
        ((100_000_001).to_bytes(8, "little") + b"{}", "the most safetensors reads"),
    ],
)
@pytest.mark.parametrize("how", ["read", "over"])
def test_tensorfile_rejects_lying_headers(raw, error, how):
    with pytest.raises(MalformedFile, match=error):
        _read_bytes(raw, how)


_EVERY_DTYPE = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.uint16, torch.uint32,
    torch.uint64, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
]  # fmt: skip


def _filled(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Values of every byte pattern a tensor of ``dtype`` may hold (random bits, not one value's)."""
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", _EVERY_DTYPE, ids=str)
def test_every_dtype_safetensors_names_is_saved_and_read_back_bit_exact(tmp_path, dtype):
    """A state holding any dtype safetensors has a name for (complex RoPE tables, unsigned counters, AMD's
    float8) is saved in a file Hugging Face's reader opens, and read back bit for bit."""
    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    tensors = {"x": _filled(dtype, (5, 7)), "y": _filled(dtype, (3,))}
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as raw:
        tensorfile.write(HashingWriter(raw), tensors)
    theirs = load_file(str(path))
    with open(path, "rb") as f:
        ours, _ = tensorfile.read(HashingReader(f, Hasher()), path.stat().st_size)
    for k, t in tensors.items():
        for got in (ours[k], theirs[k]):
            assert got.dtype == dtype and got.shape == t.shape, f"seed {seed}"
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), f"seed {seed}"


def test_tensors_over_a_file_in_memory_are_its_values_each_in_a_storage_of_its_own():
    import ctypes
    import io

    tensors = {f"t{i}": (torch.randn(64, 1000) * 4).to(dt) for i, dt in enumerate(_EVERY_DTYPE)}
    tensors |= {"c": torch.tensor(2.5), "e": torch.empty(0, 4)}
    out = io.BytesIO()
    tensorfile.write(out, tensors)
    whole = bytearray(out.getvalue())
    start = ctypes.addressof(ctypes.c_char.from_buffer(whole))
    got, _ = tensorfile.over(memoryview(whole))
    assert all(start <= t.data_ptr() < start + len(whole) for k, t in got.items() if t.numel())  # no copies
    header = _file({"x": _span("F32", [2], 0, 8)}, b"")
    misaligned = header + b"\x00\x00\x80\x3f\x00\x00\x00\x40"  # 1.0, 2.0 at an offset no float32 starts at
    assert len(header) % 4 != 0
    for raw, want in ((out.getvalue(), tensors), (misaligned, {"x": torch.tensor([1.0, 2.0])})):
        got, _ = tensorfile.over(memoryview(bytearray(raw)))
        assert set(got) == set(want)
        assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
                   for k, v in want.items() if v.dim())  # fmt: skip
        assert all(torch.equal(got[k], v) for k, v in want.items() if not v.dim())
        spans = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in got.values() if t.numel()
        )
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no tensor's bytes are another's
        assert all(t._base is None for t in got.values())  # nothing keeps a view's base alive


@pytest.mark.parametrize(
    "path",
    [
        "../x",
        "/etc/passwd",
        "a/../../b",
        "",
        "a//b",
        "a\\..\\b",
        "manifest.json",
        ".",
        "./a",
        "a\x00b",
        "\ud800",
        "n" * 256,
    ],
)
def test_manifest_refuses_escaping_paths(path):
    with pytest.raises(mf.ManifestError):
        mf.safe_relative(path)


def _listing(files: str, step: str = "1") -> bytes:
    return f'{{"format": "{mf.FORMAT}", "run": "r", "step": {step}, "files": [{files}]}}'.encode()


@pytest.mark.parametrize(
    "raw",
    [
        _listing(
            '{"path": "x", "size": 1, "xxh3": "0", "crc32c": ""}, {"path": "x/y", "size": 1, "xxh3": "0", '
            '"crc32c": ""}'
        ),
        _listing('{"path": "x", "size": 1e400, "xxh3": "0", "crc32c": ""}'),
        _listing("", step="Infinity"),
        _listing("", step="NaN"),
        _listing("", step="9" * 5000),
    ],
    ids=["file-and-directory", "infinite-size", "infinity", "nan", "huge-int"],
)
def test_a_manifest_no_copy_could_match_is_refused_in_one_line(raw):
    """A writer's bug (or a forger's) is a ManifestError, never a traceback nor a copy judged unverifiable."""
    with pytest.raises(mf.ManifestError):
        mf.parse(raw)


def test_a_manifest_with_a_non_finite_metric_is_read():
    """A save with an AMP overflow step's grad norm (inf) or a NaN loss commits; its manifest must stay readable."""
    m = mf.Manifest(run="r", step=3, files=(mf.FileEntry("a", 1, "00", "AAAAAA=="),))
    raw = m.to_bytes().replace(b'"step": 3', b'"metrics": {"grad_norm": Infinity, "loss": NaN}, "step": 3')
    assert b"Infinity" in raw and mf.parse(raw).step == 3


def test_tree_keeps_a_memmaps_values():
    """A memory-mapped array (a dataset's permutation) is saved as its values and comes back an array."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mm = np.memmap(f"{d}/perm", dtype=np.int32, mode="w+", shape=(6,))
        mm[:] = [5, 3, 1, 0, 2, 4]
        j, tensors = tree.split({"perm": mm[:5]}, "s")
        back = tree.join(json.loads(json.dumps(j)), tensors)["perm"]
        assert back.dtype == np.int32 and back.tolist() == [5, 3, 1, 0, 2]


def test_keyring_signs_rotates_and_tells_unknown_keys_from_tampering():
    m = mf.Manifest(run="r", step=3, files=(mf.FileEntry("a", 1, "00", "AAAAAA=="),))
    k1, k2 = kr.Keyring(("k1",)), kr.Keyring(("k2", "k1"))
    raw = m.to_bytes(k1)
    assert mf.parse(raw).step == 3
    assert mf.signature(raw, k1) is kr.Signature.VALID
    assert mf.signature(raw, k2) is kr.Signature.VALID  # rotated: the previous key still verifies
    assert mf.signature(raw.replace(b'"size": 1', b'"size": 2'), k1) is kr.Signature.INVALID
    assert mf.signature(raw, kr.Keyring(("k2",))) is kr.Signature.UNKNOWN_KEY  # not corrupt: unknowable here
    assert mf.signature(m.to_bytes(kr.Keyring()), k1) is kr.Signature.UNSIGNED
    assert b"k1" not in raw and kr.key_id("k1") in raw.decode()  # the id names the key, never reveals it


def test_manifest_format_1_is_still_read():
    body = mf.Manifest(run="r", step=1, files=()).body() | {"format": "rewind.checkpoint/1"}
    assert mf.parse(json.dumps(body).encode()).run == "r"


def test_key_file_must_be_private(tmp_path, monkeypatch):
    key = tmp_path / "keys"
    key.write_text("new\nold\n")
    key.chmod(0o644)
    monkeypatch.setenv(kr.FILE_ENV, str(key))
    with pytest.raises(ConfigError, match="chmod 600"):
        kr.from_env()
    key.chmod(0o600)
    assert kr.from_env().keys == ("new", "old")


class Seq(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> int:
        return i


def _take(loader: ResumableLoader, n: int) -> list[int]:
    it = iter(loader)
    return [int(x) for _ in range(n) for x in next(it)]


def test_loader_resumes_mid_epoch_at_the_next_batch():
    straight = _take(ResumableLoader(Seq(), 4, seed=3), 30)  # crosses epochs (12 batches each)
    a = ResumableLoader(Seq(), 4, seed=3)
    first = _take(a, 7)
    b = ResumableLoader(Seq(), 4, seed=3)
    b.load_state_dict(tree.join(*tree.split(a.state_dict(), "d")))
    assert first + _take(b, 23) == straight
    epoch0 = straight[:48]
    assert sorted(epoch0) == sorted(set(epoch0)) and len(epoch0) == 48  # no repeats within an epoch


def test_loader_position_is_global_across_ranks():
    one = _take(ResumableLoader(Seq(), 4, seed=1), 6)
    ranks = [_take(ResumableLoader(Seq(), 2, seed=1, rank=r, world=2), 6) for r in (0, 1)]
    merged = [x for i in range(6) for r in (0, 1) for x in ranks[r][2 * i : 2 * i + 2]]
    assert merged == one


def test_skipping_a_data_window_lands_where_iterating_would_across_epochs():
    walked = ResumableLoader(Seq(), batch_size=4, seed=3, world=2)  # 50 samples: 48 usable per epoch
    it = iter(walked)
    for _ in range(10):  # 80 samples: into the second epoch
        next(it)
    skipped = ResumableLoader(Seq(), batch_size=4, seed=3, world=2)
    skipped.skip_to(80)
    assert (skipped.epoch, skipped.consumed, skipped.position) == (
        walked.epoch,
        walked.consumed,
        walked.position,
    )
    assert _take(skipped, 2) == _take(walked, 2)
    with pytest.raises(ConfigError, match="skip back"):
        skipped.skip_to(8)


def _crc32c_by_the_book(data: bytes) -> int:
    """CRC32C bit by bit (RFC 3720: reflected polynomial 0x82F63B78): slow, and independent of any library."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_the_crc32c_a_save_records_is_the_one_s3_computes_for_any_piece_and_alignment():
    """The CRC32C in every manifest entry is what S3 servers compare against: checked against RFC 3720's
    definition over lengths and offsets that take every path of a vectorised implementation (short tails,
    unaligned starts, continuation), and through the ``Hasher`` a save uses."""
    from rewind.infra.format import digest

    assert digest.crc32c(b"123456789") == _crc32c_by_the_book(b"123456789") == 0xE3069283  # RFC 3720
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    data = memoryview(rng.randbytes(70_100))
    for length in (0, 1, 7, 63, 64, 65, 127, 128, 129, 255, 256, 1000, 4096, 8000, 70_000):
        start = rng.randrange(0, 64)
        piece = data[start : start + length]
        want = _crc32c_by_the_book(bytes(piece))
        assert digest.crc32c(piece) == want, (seed, length, start)
        cut = length // 3
        assert digest.crc32c(piece[cut:], digest.crc32c(piece[:cut])) == want, (seed, length, start)
    h = Hasher()
    h.update(data[:1000])
    h.update(data[1000:])
    assert h.result().crc32c == digest.crc32c_b64(_crc32c_by_the_book(bytes(data)))


def test_a_tensors_byte_view_is_its_values_in_order_whatever_its_layout() -> None:
    """``byte_view`` of a strided, expanded, transposed or conjugated tensor gives the bytes of its values in
    order (a copy's), never the memory around it; a tensor on another device is a ``ValueError``."""
    base = torch.arange(12, dtype=torch.float32)
    z = torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64)
    for t in (
        base[::2],
        base.reshape(3, 4)[:, ::2],
        torch.ones(1).expand(5),
        base.reshape(3, 4).t(),
        z.conj(),
    ):
        want = t.resolve_conj().contiguous()
        assert bytes(tensorfile.byte_view(t)) == bytes(tensorfile.byte_view(want)) == want.numpy().tobytes()
    with pytest.raises(ValueError, match="cannot be viewed from the CPU"):
        tensorfile.byte_view(torch.ones(2, device="meta"))
