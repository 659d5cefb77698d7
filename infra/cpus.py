"""How many CPUs, and how many cores, this process may use.

``usable()``: the CPUs of its affinity, at most its cgroup's CPU quota (``cpu.max``, cgroup v2, rounded
up: a container started with ``--cpus=2`` on a 64-CPU host has 2). ``cores()``: the same counted in
physical cores (hyperthreads of one core counted once: a torch job defaults to one thread per core),
where Linux says which CPUs share a core.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
TOPOLOGY = Path("/sys/devices/system/cpu")


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _quota() -> int | None:
    """The cgroup v2 CPU quota of this process, in CPUs rounded up; None where there is none or no cgroup v2."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        path = next(line[3:] for line in lines if line.startswith("0::"))
        fields = (CGROUP_ROOT / path.lstrip("/") / "cpu.max").read_text().split()
    except (OSError, StopIteration):
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def usable() -> int:
    """The CPUs this process may run on, at most its cgroup's quota."""
    cpus = len(_affinity()) or 1
    quota = _quota()
    return min(cpus, quota) if quota else cpus


def _core_of(cpu: int) -> tuple[str, str] | None:
    top = TOPOLOGY / f"cpu{cpu}" / "topology"
    try:
        return (top / "physical_package_id").read_text().strip(), (top / "core_id").read_text().strip()
    except OSError:
        return None


def cores() -> int:
    """The physical cores this process may run on (each CPU a core where Linux does not say), at most its
    cgroup's quota."""
    cpus = _affinity()
    found = [_core_of(c) for c in cpus]
    count = len(set(found)) if all(found) else len(cpus)
    quota = _quota()
    return max(1, min(count, quota) if quota else count)
