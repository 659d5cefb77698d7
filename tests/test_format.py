"""The checkpoint format: state trees, tensor files, manifests, and the data position."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from infra.checkpoint import manifest as mf
from infra.checkpoint import tensorfile, tree
from infra.checkpoint.state import RNGState
from infra.digest import HashingWriter
from infra.training.data import ResumableLoader


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
    py, npy = back["rng"]["python"], back["rng"]["numpy"]
    random.setstate(py)
    np.random.set_state(npy)


def test_tree_refuses_unknown_objects():
    with pytest.raises(TypeError, match=r"at 'x.bad'"):
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
    buf = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    ours, _ = tensorfile.parse(buf)
    for k, t in tensors.items():
        assert torch.equal(other[k], t) and torch.equal(ours[k], t) and ours[k].dtype == t.dtype


def test_tensorfile_rejects_lying_headers():
    buf = torch.frombuffer(bytearray(b"\xff" * 8 + b"{}"), dtype=torch.uint8)
    with pytest.raises(ValueError, match="runs past"):
        tensorfile.parse(buf)


@pytest.mark.parametrize(
    "path", ["../x", "/etc/passwd", "a/../../b", "", "a//b", "a\\..\\b", "manifest.json"]
)
def test_manifest_refuses_escaping_paths(path):
    with pytest.raises(mf.ManifestError):
        mf.safe_relative(path)


def test_manifest_hmac_detects_tampering(monkeypatch):
    monkeypatch.setenv(mf.KEY_ENV, "k1")
    m = mf.Manifest(run="r", step=3, files=(mf.FileEntry("a", 1, "00", "AAAAAA=="),))
    raw = m.to_bytes()
    assert mf.parse(raw).step == 3
    with pytest.raises(mf.ManifestError, match="HMAC"):
        mf.parse(raw.replace(b'"size": 1', b'"size": 2'))
    monkeypatch.setenv(mf.KEY_ENV, "k2")
    with pytest.raises(mf.ManifestError, match="HMAC"):
        mf.parse(raw)


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
