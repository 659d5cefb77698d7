"""Multi-rank checkpoints: saved by 4 ranks, loaded by 2 and by 1, every tensor equal (gloo on CPU); the files
read by DCP's own reader too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rewind.infra.format.verify import check_copy
from tests.torchrun_support import torchrun as torchrun_cmd

REPO = Path(__file__).resolve().parents[1]


def torchrun(n: int, mode: str, kind: str, work: Path) -> None:
    cmd = [
        *torchrun_cmd(n),
        "-m",
        "tests.dist_worker",
        mode,
        kind,
        str(work),
    ]
    r = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={"OMP_NUM_THREADS": "1", **__import__("os").environ},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_save_with_4_ranks_load_with_2_and_1(kind, tmp_path):
    torchrun(4, "save", kind, tmp_path)
    directory = tmp_path / "ckpt" / "step-3"
    report = check_copy(directory, None, deep=True)
    assert report.ok, report.findings
    assert {f.path for f in report.manifest.files} >= {
        ".metadata",
        "state.json",
        "rank-0.json",
        "rank-3.json",
    }
    expected = load_file(str(tmp_path / "expected.safetensors"))
    assert any(k.startswith("optim/") for k in expected)
    # written by Rewind's own writer, read by DCP's alone (no Rewind): every model tensor as saved
    dcp_to_torch_save(directory, tmp_path / "by-dcp.pt")
    loaded = torch.load(tmp_path / "by-dcp.pt", weights_only=True)
    by_dcp = {k.removeprefix("s.model."): v for k, v in loaded.items() if k.startswith("s.model.")}
    assert {f"model/{k}" for k in by_dcp} == {k for k in expected if k.startswith("model/")}
    assert all(torch.equal(v, expected[f"model/{k}"]) for k, v in by_dcp.items())
    for n in (2, 1):
        torchrun(n, "load", kind, tmp_path)
        got = load_file(str(tmp_path / f"loaded-{n}.safetensors"))
        assert got.keys() == expected.keys()
        for k in expected:
            assert torch.equal(got[k], expected[k]), f"{k} differs after loading into {n} ranks"
        assert "'consumed': 48" in (tmp_path / f"rank-state-{n}.txt").read_text()


def test_damaged_shard_is_refused_before_dcp_reads_anything(tmp_path):
    torchrun(2, "save", "ddp", tmp_path)
    meta = tmp_path / "ckpt" / "step-3" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01
    meta.write_bytes(bytes(data))
    cmd_ok = True
    try:
        torchrun(1, "load", "ddp", tmp_path)
    except AssertionError as exc:
        cmd_ok = False
        assert "digest_mismatch" in str(exc) and ".metadata" in str(exc)
    assert not cmd_ok
