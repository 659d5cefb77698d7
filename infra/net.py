"""Loopback ports for the servers Rewind starts (TorchServe, HAProxy; S3 and Prefect in tests)."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free right now on 127.0.0.1; the caller binds it soon after."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
