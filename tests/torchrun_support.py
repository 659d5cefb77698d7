"""How the tests start a multi-rank job on this machine."""

from __future__ import annotations

import sys


def torchrun(n: int) -> list[str]:
    """``torchrun --standalone`` with ``n`` ranks: its store binds a port the OS picks (port 0), so two
    tests, or a test and a server another test is starting, never race for one chosen beforehand."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--standalone"]
