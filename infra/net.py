"""Loopback ports for the servers Rewind starts (TorchServe, HAProxy; S3 and Prefect in tests), and a place
short enough for their Unix sockets."""

from __future__ import annotations

import hashlib
import os
import random
import socket
import stat
import tempfile
from pathlib import Path

from rewind.infra.errors import ConfigError

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free right now on 127.0.0.1, for a server the caller (or a process it starts) binds soon after.

    Taken below the kernel's ephemeral range (``ip_local_port_range``) where there is room: a port from
    that range, free a moment ago, is the kind the kernel hands the next connection's local end or another
    ``bind(0)`` meanwhile (a relaunched torchrun whose rendezvous port a memory agent's catalog connection
    had taken failed to start). Inside the range only where nothing lies below it."""
    low = _ephemeral_low()
    below = [p for p in range(max(1024, low - EPHEMERAL_SPAN), low) if p not in TORCH_PORTS]
    for port in random.sample(below, min(PORT_TRIES, len(below))):
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


EPHEMERAL_SPAN = 12288  # ports taken from just below the ephemeral range (20480-32767 by Linux's default)
PORT_TRIES = 64
TORCH_PORTS = range(29400, 30000)  # torch's default rendezvous and master ports, and Slurm launches' (29400+)
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


SOCKET_PATH_MAX = 95  # 107 usable bytes in sun_path, less HAProxy's ".<pid>.tmp" while it binds (12 at most)


def socket_dir(directory: Path, *, room: int, tag: str) -> Path:
    """Where Unix sockets of ``directory`` go: ``directory`` itself where its path leaves ``room`` bytes for
    a socket's name within ``SOCKET_PATH_MAX``; else a short private directory in the system's temp directory,
    derived from ``directory`` and ``tag`` (the same on every call), refused unless it is this user's own."""
    if len(str(directory.resolve())) + 1 + room <= SOCKET_PATH_MAX:
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    digest = hashlib.sha256(f"{tag}:{directory.resolve()}".encode()).hexdigest()[:16]
    short = Path(tempfile.gettempdir()) / f"rewind-{tag}-{os.getuid()}-{digest}"
    short.mkdir(mode=0o700, exist_ok=True)
    st = short.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{short} is not a private directory of this user: refusing to put sockets there")
    return short
