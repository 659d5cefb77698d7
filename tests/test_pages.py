"""A large tensor a restore reads into lies on huge pages where THP is offered on advice, and the advice
covers that tensor's own mapping and nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from rewind.infra.format import pages

MODE = pages.thp_mode()
ROOT = Path(__file__).resolve().parents[1]


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


_READ_BACK = """
import sys, torch
from pathlib import Path
from rewind.infra.format import tensorfile
from rewind.infra.format.digest import Hasher, HashingReader, HashingWriter
from tests.test_pages import _huge_kib
big, small = torch.randn(16 << 20), torch.arange(10)  # 64 MiB and 80 bytes
path = Path(sys.argv[1])
with open(path, "wb") as raw:
    tensorfile.write(HashingWriter(raw), {"big": big, "small": small})
with open(path, "rb") as f:
    got, _ = tensorfile.read(HashingReader(f, Hasher()), path.stat().st_size)
assert torch.equal(got["big"], big) and torch.equal(got["small"], small)
plain = torch.empty(16 << 20)  # the same allocation written alike, not advised
plain.copy_(big)
print(_huge_kib(got["big"]), _huge_kib(plain))
"""


@pytest.mark.skipif(MODE != "madvise", reason=f"THP mode {MODE}: huge pages come (or not) without advice")
def test_a_large_tensor_read_back_lies_on_huge_pages(tmp_path: Path) -> None:
    # a fresh process, as a job restoring at its start: this one's heap may hold large free chunks (where
    # a tensor is rightly not advised: test below)
    out = subprocess.run([sys.executable, "-c", _READ_BACK, str(tmp_path / "x.safetensors")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)  # fmt: skip
    restored, plain = (int(x) for x in out.stdout.split())
    assert restored > 0, "the restored tensor has no huge page"
    assert plain == 0  # the advice made it


def test_the_advice_covers_the_tensors_own_mapping_alone() -> None:
    t = torch.empty(pages.MIN_HUGE_BYTES // 4 + 1000)  # just past the size threshold
    span = pages.huge_range(t)
    end = t.data_ptr() + t.numel() * 4
    holding = [(lo, hi, name) for lo, hi, name in _mappings() if lo < end and t.data_ptr() < hi]
    if any(name == "[heap]" for _, _, name in holding):  # a large free chunk of the heap reused
        assert span is None, "advice inside the malloc heap would outlive the tensor"
    else:
        assert span is not None
        first, nbytes = span
        assert first % pages.PAGE == 0 and nbytes % pages.PAGE == 0
        assert 0 <= t.data_ptr() - first < pages.PAGE and end <= first + nbytes < end + pages.PAGE
        assert len(holding) == 1, holding  # one anonymous mapping
    # a view, not a new allocation: freeing one under 32 MiB would raise this process's mmap threshold
    assert pages.huge_range(t[: pages.MIN_HUGE_BYTES // 4 - 1]) is None  # too small: may lie in the heap
    assert pages.huge_range(torch.empty(1 << 24, 2)[:, 0]) is None  # not contiguous


def test_a_tensor_made_by_another_thread_is_not_advised() -> None:
    got: list[tuple[int, int] | None] = []
    worker = threading.Thread(target=lambda: got.append(pages.huge_range(torch.empty(16 << 20))))
    worker.start()
    worker.join(timeout=60)
    assert got == [None]  # its arena's mappings are reused by other allocations
