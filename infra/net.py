"""Loopback ports for the servers Rewind starts (TorchServe, HAProxy; S3 and Prefect in tests), and a place
short enough for their Unix sockets."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import tempfile
from pathlib import Path

from rewind.infra.errors import ConfigError

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free right now on 127.0.0.1; the caller binds it soon after."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


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
