"""A rank's DCP file as Rewind writes it (``DirectWriter``): item for item the bytes DCP's own
``FileSystemWriter`` writes, read back by DCP's own reader, its manifest entry the digest of the bytes on
disk (direct writes on and off), and a write the disk refuses reported as the disk's error."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rewind.infra.format.dcp_direct import DirectWriter
from rewind.infra.format.digest import hash_file

REPO = Path(__file__).resolve().parents[1]


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    base = torch.randn(10, 10)
    big = torch.randn(3 << 20)  # 12 MiB: more than the direct writer's buffer
    return {
        "slice": base[2:5],  # its storage larger than the tensor
        "transposed": base.t(),
        "strided": base[:, ::3],
        "zero_d": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "bool": torch.rand(9) > 0.5,
        "quantized": torch.quantize_per_tensor(torch.randn(5, 5), 0.1, 3, torch.qint8),
        "big": big,
        "big_view": big[1:],
        "value": {"a": 1, "b": [1, 2, "x"]},
        "bytes": io.BytesIO(b"abc" * 1000),
    }


def _items(directory: Path) -> dict[object, bytes]:
    """Each item's bytes, where ``.metadata`` says it lies."""
    with open(directory / ".metadata", "rb") as f:
        meta = pickle.load(f)  # a file this test wrote a moment ago
    files: dict[str, bytes] = {}
    out = {}
    for index, info in meta.storage_data.items():
        raw = files.setdefault(info.relative_path, (directory / info.relative_path).read_bytes())
        out[index] = raw[info.offset : info.offset + info.length]
    return out


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_the_file_is_dcps_own_item_for_item_and_its_entry_is_the_bytes_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    monkeypatch.setenv("REWIND_DIRECT_WRITES", direct)
    warnings.filterwarnings("ignore", message=".*process group.*")
    state = _state()
    ours, theirs = tmp_path / "rewind", tmp_path / "dcp"
    ours.mkdir()
    theirs.mkdir()
    writer = DirectWriter(ours)
    dcp.save(state, storage_writer=writer)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(theirs)))
    assert _items(ours) == _items(theirs)
    (entry,) = writer.entries
    on_disk = hash_file(ours / entry.path)
    assert (entry.size, entry.xxh3, entry.crc32c) == (on_disk.size, on_disk.xxh3, on_disk.crc32c)
    back = {
        k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor) and not v.is_quantized
    }
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(ours)))
    assert all(torch.equal(v, state[k]) for k, v in back.items())


_REFUSED = """
import resource, signal, sys, warnings
from pathlib import Path
import torch, torch.distributed.checkpoint as dcp
from rewind.infra.format.dcp_direct import DirectWriter
warnings.filterwarnings("ignore")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (5 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
writer = DirectWriter(Path(sys.argv[1]))
try:
    dcp.save({"a": torch.randn(3 << 20)}, storage_writer=writer)
except BaseException as exc:
    print("raised:", exc)
print("entries:", len(writer.entries))
"""


def test_a_write_the_disk_refuses_is_reported_as_the_disks_error_and_leaves_no_entry(tmp_path: Path) -> None:
    """The kernel refuses writes past a file-size limit (RLIMIT_FSIZE, in a process of its own): the save
    fails with that error, not torch's account of a stream position, and records no file."""
    done = subprocess.run([sys.executable, "-c", _REFUSED, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert "File too large" in done.stdout and "entries: 0" in done.stdout, done.stdout + done.stderr[-2000:]
