"""A test S3 server (SeaweedFS) whose port another process takes between being chosen and being bound."""

from __future__ import annotations

import socket

import pytest

from rewind.infra.drills import servers
from rewind.infra.net import LOOPBACK

pytestmark = pytest.mark.skipif(bool(servers.missing("seaweedfs")), reason="no weed binary")


def test_a_first_start_on_a_taken_port_moves_to_new_ports_and_a_restart_keeps_them(tmp_path):  # type: ignore[no-untyped-def]
    server = servers.SeaweedS3(tmp_path / "weed")
    taken = server.ports["s3.port.iceberg"]
    with socket.socket() as squatter:
        squatter.bind((LOOPBACK, taken))
        squatter.listen()
        try:
            server.start()
            assert server.ports["s3.port.iceberg"] != taken
            assert "Buckets" in server.client().list_buckets()
            ports = dict(server.ports)
            server.stop()
            server.start()  # its clients know these ports: a restart keeps them
            assert server.ports == ports and "Buckets" in server.client().list_buckets()
        finally:
            server.stop()
