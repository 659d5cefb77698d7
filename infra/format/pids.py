"""Processes named by pid: whether one still runs, and where a pid names the same process.

A pid means something only on the boot of the host and in the pid namespace that gave it: a name that
records a pid for another process to judge (a temporary directory, a lease) must record that too
(``space``), and only a process of the same space may judge it gone.
"""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether a process with this pid runs in this pid namespace (one of another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def space() -> str | None:
    """Where this process's pids mean something: this boot of this host (``boot_id``: a directory or a
    catalog shared between hosts must not have one host judge another's pids) and its pid namespace (its
    inode: a container's pids are not the host's); None where either cannot be told."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip().replace("-", "")
        ns = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, UnicodeDecodeError):
        return None
    return f"{boot}.{ns}" if boot.isascii() and boot.isalnum() else None
