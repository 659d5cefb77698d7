"""A large tensor a restore reads into lies on huge pages where THP is offered on advice, and the advice
covers that tensor's own mapping and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rewind.infra.format import pages, tensorfile
from rewind.infra.format.digest import Hasher, HashingReader, HashingWriter

MODE = pages.thp_mode()


def _mappings() -> list[tuple[int, int, str]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        out.append((lo, hi, line.split()[-1] if len(line.split()) > 5 else ""))
    return out


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold ``t``'s bytes (/proc/self/smaps)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) < hi and lo < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def _read_back(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as raw:
        tensorfile.write(HashingWriter(raw), tensors)
    with open(path, "rb") as f:
        got, _ = tensorfile.read(HashingReader(f, Hasher()), path.stat().st_size)
    return got


@pytest.mark.skipif(MODE != "madvise", reason=f"THP mode {MODE}: huge pages come (or not) without advice")
def test_a_large_tensor_read_back_lies_on_huge_pages(tmp_path: Path) -> None:
    big, small = torch.randn(16 << 20), torch.arange(10)  # 64 MiB and 80 bytes
    got = _read_back(tmp_path, {"big": big, "small": small})
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)
    assert _huge_kib(got["big"]) > 0, "the restored tensor has no huge page"
    plain = torch.empty(16 << 20)  # the same allocation written alike, not advised: none
    plain.copy_(big)
    assert _huge_kib(plain) == 0


def test_the_advice_covers_the_tensors_own_mapping_alone() -> None:
    t = torch.empty(pages.MIN_HUGE_BYTES // 4 + 1000)  # just past the threshold
    span = pages.huge_range(t)
    assert span is not None
    first, nbytes = span
    end = t.data_ptr() + t.numel() * 4
    assert first % pages.PAGE == 0 and nbytes % pages.PAGE == 0
    assert 0 <= t.data_ptr() - first < pages.PAGE and end <= first + nbytes < end + pages.PAGE  # its pages
    holding = [(lo, hi, name) for lo, hi, name in _mappings() if lo < first + nbytes and first < hi]
    assert len(holding) == 1 and holding[0][2] != "[heap]", holding  # one anonymous mapping of its own
    assert pages.huge_range(torch.empty(pages.MIN_HUGE_BYTES // 4 - 1)) is None  # may lie in the heap
    assert pages.huge_range(torch.empty(1 << 24, 2)[:, 0]) is None  # not contiguous
