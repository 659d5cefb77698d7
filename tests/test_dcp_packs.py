"""The packed DCP writer on its own (one process, no process group): every item comes back as DCP's own
writer would have stored it, whatever the item is, through the verifying reader."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from rewind.infra.format import dcp as verified
from rewind.infra.format import manifest as mf
from rewind.infra.format.dcp_packs import PackedWriter
from rewind.infra.format.digest import hash_file


def _saved(state: dict[str, object], directory: Path) -> dict[str, mf.FileEntry]:
    writer = PackedWriter(directory, rank=0, parent=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.save(state, storage_writer=writer)
    d = hash_file(directory / ".metadata")
    entries = {e.path: e for e in writer.written.entries}
    entries[".metadata"] = mf.FileEntry(".metadata", d.size, d.xxh3, d.crc32c)
    return entries


def _stored(directory: Path, entries: dict[str, mf.FileEntry]) -> dict[str, object]:
    """Each item decoded from the pack bytes the metadata points at, the pack proven first."""
    reader = verified.VerifiedReader(directory, entries)
    metadata = reader.read_metadata()
    out: dict[str, object] = {}
    for index, info in metadata.storage_data.items():
        raw = reader.verified.read_verified(directory / info.relative_path).getvalue()
        out[index.fqn] = torch.load(
            io.BytesIO(raw[info.offset : info.offset + info.length]), weights_only=True
        )
    return out


def test_items_with_the_same_element_bytes_but_different_scales_or_bits_are_stored_apart(
    tmp_path: Path,
) -> None:
    x = torch.rand(64, generator=torch.Generator().manual_seed(0))
    z = torch.complex(x, x.flip(0))
    state = {
        "q1": torch.quantize_per_tensor(x, 0.1, 0, torch.quint8),
        "q2": torch.quantize_per_tensor(x * 2, 0.2, 0, torch.quint8),  # the same integers, another scale
        "z": z,
        "zc": z.conj(),  # the same bytes, the conjugate bit set
        "same1": x.clone(),
        "same2": x.clone(),  # the same content twice: stored once
    }
    got = _stored(tmp_path, _saved(state, tmp_path))
    assert got["q1"].q_scale() == 0.1 and got["q2"].q_scale() == 0.2  # type: ignore[attr-defined]
    assert torch.equal(got["q1"].dequantize(), state["q1"].dequantize())  # type: ignore[attr-defined]
    assert torch.equal(got["zc"].resolve_conj(), z.conj().resolve_conj())  # type: ignore[attr-defined]
    assert torch.equal(got["z"], z)  # type: ignore[arg-type]
    assert torch.equal(got["same1"], x) and torch.equal(got["same2"], x)  # type: ignore[arg-type]
