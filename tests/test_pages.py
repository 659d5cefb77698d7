"""Large buffers a restore reads into, and staging buffers, are backed by huge pages where THP is offered."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rewind.infra.checkpoint.staging import StagingBuffer
from rewind.infra.format import tensorfile
from rewind.infra.format.digest import Hasher, HashingReader, HashingWriter

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MODE = re.search(r"\[(\w+)\]", _THP.read_text()).group(1) if _THP.exists() else "none"  # type: ignore[union-attr]
needs_thp = pytest.mark.skipif(MODE not in ("madvise", "always"), reason=f"THP mode {MODE}: no huge pages")


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold ``t``'s bytes (/proc/self/smaps; advice splits a mapping)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) < hi and lo < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@needs_thp
def test_a_large_tensor_read_back_lies_on_huge_pages(tmp_path):
    big = torch.randn(16 << 20)  # 64 MiB: past glibc's mmap threshold, a mapping of its own
    small = torch.arange(10)
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as raw:
        tensorfile.write(HashingWriter(raw), {"big": big, "small": small})
    with open(path, "rb") as f:
        got, _ = tensorfile.read(HashingReader(f, Hasher()), path.stat().st_size)
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)
    assert _huge_kib(got["big"]) >= 2048, f"THP {MODE}: the restored tensor has no huge page"
    if MODE == "madvise":  # the advice made it: a plain allocation written alike has none
        plain = torch.empty(16 << 20)
        plain.copy_(big)
        assert _huge_kib(plain) == 0


@needs_thp
def test_a_staging_buffer_lies_on_huge_pages():
    parts = {"model": {"w": torch.randn(16 << 20)}}
    buf = StagingBuffer()
    buf.prepare(parts)
    staged = buf.stage(parts)
    assert torch.equal(staged.parts["model"]["w"], parts["model"]["w"])
    assert _huge_kib(staged.parts["model"]["w"]) >= 2048, f"THP {MODE}: the staging buffer has no huge page"
