"""Where a node's memory tier lies and how much it may hold, from the environment.

``REWIND_MEMORY_ROOT``: its directory, on a memory filesystem (default ``/dev/shm/rewind-<uid>``, POSIX
shared memory on Linux; ``off`` turns the tier off). ``REWIND_MEMORY_BUDGET``: the most bytes it holds
(a size such as ``8GiB``; default a quarter of the memory the process may use: the machine's, or its
cgroup's limit where lower (a Slurm job's, a pod's: the tier's pages are charged to it); at most half the
memory filesystem: a container's /dev/shm may be 64 MB). ``REWIND_MEMORY_KEEP``: the newest
checkpoints of each run it holds (default 1: a crash restores the newest; older ones are on disk).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rewind.infra import sizes
from rewind.infra.errors import ConfigError

SHM = Path("/dev/shm")
ROOT_ENV, BUDGET_ENV, KEEP_ENV = "REWIND_MEMORY_ROOT", "REWIND_MEMORY_BUDGET", "REWIND_MEMORY_KEEP"
OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryConfig:
    root: Path
    budget_bytes: int
    keep: int


def root() -> Path | None:
    """The memory tier's directory on this node; None when it is off or the machine has no /dev/shm."""
    raw = os.environ.get(ROOT_ENV, "").strip()
    if raw.lower() == OFF:
        return None
    if raw:
        return Path(raw).expanduser()
    return SHM / f"rewind-{os.getuid()}" if SHM.is_dir() and os.access(SHM, os.W_OK) else None


CGROUPS = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 62  # cgroup v1 says "no limit" with a number near 2**63


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), mounts: Path = CGROUPS) -> int | None:
    """The lowest memory limit on this process's cgroup and the cgroups above it (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``); None where there is none, or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            found += _limits(mounts, mounts / path.lstrip("/"), "memory.max")
        elif "memory" in controllers.split(","):
            found += _limits(mounts / "memory", mounts / "memory" / path.lstrip("/"), "memory.limit_in_bytes")
    return min(found, default=None)


def _limits(top: Path, leaf: Path, name: str) -> list[int]:
    """The numeric limits in ``name`` from ``leaf`` up to ``top`` (``max`` and v1's near-2**63: none)."""
    got: list[int] = []
    for d in (leaf, *leaf.parents):
        try:
            raw = (d / name).read_text().strip()
        except OSError:
            raw = ""
        if raw.isdigit() and int(raw) < NO_LIMIT:
            got.append(int(raw))
        if d == top or top not in d.parents:
            break
    return got


def default_budget(where: Path) -> int:
    fs = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
    st = os.statvfs(fs)
    usable = min(machine_memory(), cgroup_limit() or machine_memory())
    return min(usable // 4, st.f_blocks * st.f_frsize // 2)


def config() -> MemoryConfig | None:
    """The memory tier as the environment sets it (None: off); a bad setting is refused in one line."""
    where = root()
    if where is None:
        return None
    raw_budget = os.environ.get(BUDGET_ENV, "").strip()
    budget = sizes.parse(raw_budget, what=BUDGET_ENV) if raw_budget else default_budget(where)
    raw_keep = os.environ.get(KEEP_ENV, "").strip() or "1"
    if not raw_keep.isdigit() or int(raw_keep) < 1:
        raise ConfigError(f"{KEEP_ENV}: {raw_keep!r} is not a whole number of checkpoints (1 or more)")
    return MemoryConfig(root=where, budget_bytes=budget, keep=int(raw_keep))
