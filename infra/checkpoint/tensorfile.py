"""Streamed safetensors files: written through a hasher, read into one buffer.

The layout is plain safetensors, so any tool can open ``model.safetensors``; we
write and read it ourselves to hash while writing and to load without a second
copy. Tensors are ordered by element size, largest first, so every tensor starts
at an offset aligned to its element size and can be a view of the read buffer.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import BinaryIO

import torch

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


def _byte_view(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """Return the padded header and the order in which tensor bytes follow it."""
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def write(
    out: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Stream CPU tensors to ``out`` (any object with ``write``)."""
    head, order = layout(tensors, metadata)
    out.write(head)
    for name in order:
        t = tensors[name]
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.detach().to("cpu").contiguous()
        out.write(_byte_view(t))


def parse(buf: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors as views of ``buf`` (a uint8 tensor holding a whole file)."""
    total = buf.numel()
    if total < 8:
        raise ValueError("file is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
    if 8 + n > total:
        raise ValueError(f"header length {n} runs past the end of the file ({total} bytes)")
    header = json.loads(bytes(buf[8 : 8 + n].numpy()))
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        dtype = _BY_NAME.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']!r}")
        start, end = info["data_offsets"]
        shape = [int(s) for s in info["shape"]]
        count = 1
        for s in shape:
            count *= s
        if (
            not 0 <= start <= end <= total - base
            or end - start != count * torch.empty(0, dtype=dtype).element_size()
        ):
            raise ValueError(
                f"tensor {name!r} has offsets {start}..{end} that do not fit its shape or the file"
            )
        out[name] = buf[base + start : base + end].view(dtype).reshape(shape)
    return out, metadata
