"""Streamed safetensors files: written through a hasher, read into one buffer.

The layout is plain safetensors, so any tool can open ``model.safetensors``; we
write and read it ourselves to hash while writing, and to read each file once,
hashing it, with every tensor landing directly in storage of its own. Tensors are
written ordered by element size, largest first, so every tensor starts at an
offset aligned to its element size. A file of at least ``PAGE_FROM`` bytes of tensors
has its header padded with spaces (as safetensors allows) so that its tensors start
on a ``PAGE`` boundary: tensors staged in that order from a page-aligned address
(``rewind.infra.checkpoint.staging``) then lie at the addresses their bytes take in
the file, and a direct writer sends them to the disk from where they are.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from rewind.infra.errors import ConfigError, MalformedFile
from rewind.infra.format import pages
from rewind.infra.format.digest import HashingReader

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
    # the names safetensors (and so Hugging Face's tools) gives these too: RoPE tables kept as complex
    # buffers, unsigned ids and counters, AMD's float8
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_MAX_DIM = 1 << 40  # no real dimension is larger; an empty tensor could otherwise claim any shape
PAGE = 4096  # the tensors of a large file start on such a boundary
MAX_HEADER = 100_000_000  # safetensors' own limit: a longer header is a damaged or hostile file
PAGE_FROM = 1 << 20  # from this many bytes of tensors; a smaller file is not made 4 KiB longer


def file_order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The order tensors take in a file: element size, largest first (so each is aligned to its own), then name."""
    return sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))


def dtype_name(name: str, dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``ConfigError`` for one it cannot store)."""
    if dtype not in _DTYPES:
        raise ConfigError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
    return _DTYPES[dtype]


def dtype_named(name: str, dtype: object) -> torch.dtype:
    """The dtype a file names for tensor ``name`` (``MalformedFile`` for one this reader lacks)."""
    found = _BY_NAME.get(dtype) if isinstance(dtype, str) else None
    if found is None:
        raise MalformedFile(f"tensor {name!r} has unsupported dtype {dtype!r}")
    return found


def checked_shape(name: str, shape: object) -> list[int]:
    """A shape from a file: a list of sane, non-negative dimensions (``MalformedFile`` otherwise)."""
    if not isinstance(shape, list) or not all(type(n) is int and 0 <= n <= _MAX_DIM for n in shape):
        raise MalformedFile(f"tensor {name!r} has a malformed shape {str(shape)[:100]}")
    return shape


def allocate(name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor to read into (``MalformedFile`` for a shape torch refuses)."""
    try:
        return pages.empty(shape, dtype)  # huge pages for a large one: a third of the faults' cost
    except RuntimeError as exc:  # a shape torch cannot allocate, however few bytes it claims
        raise MalformedFile(f"tensor {name!r} has shape {shape}, which torch refuses: {exc}") from exc


def byte_view(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy (empty for an empty tensor), writable; the view holds the tensor.

    Made over the tensor's address, not through ``Tensor.numpy()``, which marks the storage not resizable for
    good: a save must leave the job's tensors as they were (a buffer the job grows with ``resize_`` after a
    checkpoint). The tensor must not be resized while the view is in use. A tensor whose bytes are not its
    values in order (lazily conjugated or negated: ``conj()``, the ``imag`` of one; not contiguous) gives
    a copy's: read them, never write into them (every tensor read into is one of Rewind's own, contiguous).
    ``ValueError`` for a tensor not in the CPU's memory."""
    if t.device.type != "cpu":
        raise ValueError(f"the bytes of a tensor on {t.device} cannot be viewed from the CPU")
    flat = t.detach().resolve_conj().resolve_neg().contiguous().view(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    raw = (ctypes.c_ubyte * (flat.numel() * flat.element_size())).from_address(flat.data_ptr())
    raw.held = flat  # type: ignore[attr-defined]  # the view holds the array, the array the tensor
    return memoryview(raw).cast("B")


def layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """Return the padded header and the order in which tensor bytes follow it."""
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise ConfigError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
    order = file_order(tensors)
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
    raw += b" " * (-(len(raw) + 8) % (PAGE if offset >= PAGE_FROM else 8))
    return struct.pack("<Q", len(raw)) + raw, order


def write(
    out: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Stream CPU tensors to ``out`` (any object with ``write``)."""
    head, order = layout(tensors, metadata)
    out.write(head)
    run: list[torch.Tensor] = []  # tensors that lie back to back in one storage: written as one span
    for name in order:
        t = tensors[name].detach().resolve_conj().resolve_neg()  # a lazy conjugate's values, not its bytes
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()
        if t.numel() == 0:
            continue
        if run and not _follows(run[-1], t):
            out.write(_span(run))
            run = []
        run.append(t)
    if run:
        out.write(_span(run))


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b``'s bytes start where ``a``'s end, in the same storage."""
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()
    )


def _span(run: list[torch.Tensor]) -> memoryview:
    """The bytes of tensors that lie back to back (``_follows``), as one view: one write, not one per tensor."""
    if len(run) == 1:
        return byte_view(run[0])
    first, last = run[0], run[-1]
    nbytes = last.data_ptr() + last.numel() * last.element_size() - first.data_ptr()
    start = first.data_ptr() - first.untyped_storage().data_ptr()
    whole = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage(), start, (nbytes,), (1,))
    return byte_view(whole)


@dataclass(frozen=True, slots=True)
class Span:
    name: str
    dtype: torch.dtype
    shape: list[int]
    start: int
    end: int


def _spans(header: dict[str, Any], data_bytes: int) -> list[Span]:
    """Validate every header entry against the data size; return them in file order, non-overlapping."""
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise MalformedFile(f"tensor {name!r} has a malformed header entry")
        dtype = dtype_named(name, info.get("dtype"))
        shape = checked_shape(name, info.get("shape"))
        offsets = info.get("data_offsets")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(x) is int for x in offsets):
            raise MalformedFile(f"tensor {name!r} has malformed offsets {str(offsets)[:100]}")
        start, end = offsets
        count = math.prod(shape)
        if (
            not 0 <= start <= end <= data_bytes
            or end - start != count * torch.empty(0, dtype=dtype).element_size()
        ):
            raise MalformedFile(
                f"tensor {name!r} has offsets {start}..{end} that do not fit its shape or the file"
            )
        spans.append(Span(name, dtype, shape, start, end))
    spans.sort(key=lambda sp: (sp.start, sp.end))
    for a, b in itertools.pairwise(spans):
        if b.start < a.end:
            raise MalformedFile(f"tensors {a.name!r} and {b.name!r} overlap")
    return spans


def read(reader: HashingReader, size: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a ``size``-byte file once, each tensor straight into storage of its own.

    Every byte passes through ``reader``'s hasher; the caller compares the digest
    before using anything returned. No tensor is a view of a shared buffer, so a
    state that keeps a tensor (a generator state, a buffer) gets one it owns.
    Raises ``ValueError`` for a malformed file, ``EOFError`` if it ends early.
    """
    head = bytearray(8)
    if size < 8 or not reader.fill(memoryview(head)):
        raise EOFError("file is shorter than a safetensors header")
    n = _header_length(bytes(head), size)
    raw = bytearray(n)
    if not reader.fill(memoryview(raw)):
        raise EOFError("file ended inside its header")
    spans, metadata = _decode_header(raw, size - 8 - n)
    out: dict[str, torch.Tensor] = {}
    pos = 0
    for sp in spans:
        if not reader.skip(sp.start - pos):
            raise EOFError("file ended before its tensors")
        t = allocate(sp.name, sp.shape, sp.dtype)
        if sp.end > sp.start and not reader.fill(byte_view(t)):
            raise EOFError(f"file ended inside tensor {sp.name!r}")
        out[sp.name] = t
        pos = sp.end
    return out, metadata


def header_end(mapping: memoryview) -> int:
    """Where the header of a whole file in memory ends: its first 8 bytes read, nothing after them.
    Raises ``ValueError`` for a malformed file."""
    return 8 + _header_length(bytes(mapping[:8]), len(mapping))


def laid_out(mapping: memoryview) -> tuple[int, list[Span], dict[str, str]]:
    """Where a whole file in memory holds its tensors: the offset their data starts at, each tensor's span
    from there (in file order), the metadata; the header read, nothing after it. ``ValueError`` for a
    malformed file."""
    start = header_end(mapping)
    spans, metadata = _decode_header(mapping[8:start], len(mapping) - start)
    return start, spans, metadata


def over(mapping: memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a whole file already in memory (a private mapping the caller proved), made over its
    bytes without a copy: each tensor has a storage of its own over its own bytes (one that lies at an
    offset not aligned to its element size is copied). Raises ``ValueError`` for a malformed file."""
    data, spans, metadata = laid_out(mapping)
    out: dict[str, torch.Tensor] = {}
    for sp in spans:
        itemsize = torch.empty(0, dtype=sp.dtype).element_size()
        at, count = data + sp.start, (sp.end - sp.start) // itemsize
        if count == 0:
            t = allocate(sp.name, sp.shape, sp.dtype)
        elif at % itemsize:  # no tensor of this dtype can start there: a copy of its own
            t = allocate(sp.name, sp.shape, sp.dtype)
            byte_view(t)[:] = mapping[at : data + sp.end]
        else:
            flat = torch.frombuffer(mapping, dtype=sp.dtype, count=count, offset=at)
            stride = torch.empty(sp.shape, dtype=sp.dtype, device="meta").stride()
            t = torch.empty(0, dtype=sp.dtype).set_(flat.untyped_storage(), 0, sp.shape, stride)  # not a view
        out[sp.name] = t
    return out, metadata


def _header_length(head: bytes, size: int) -> int:
    if size < 8 or len(head) < 8:
        raise EOFError("file is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER:
        raise MalformedFile(f"header length {n} is over {MAX_HEADER} bytes, the most safetensors reads")
    if 8 + n > size:
        raise MalformedFile(f"header length {n} runs past the end of the file ({size} bytes)")
    return int(n)


def _decode_header(raw: bytes | bytearray | memoryview, data_bytes: int) -> tuple[list[Span], dict[str, str]]:
    """The header's tensors in file order (validated against ``data_bytes``) and its metadata."""
    try:
        header = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise MalformedFile(f"header is not JSON ({str(exc)[:100]})") from exc
    if not isinstance(header, dict):
        raise MalformedFile("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise MalformedFile("header metadata is not a JSON object")
    return _spans(header, data_bytes), {str(k): str(v) for k, v in metadata.items()}
