"""Servers the drills and the tests start (``servers.Spawned``): one that never answers is not left running;
a SeaweedFS whose port another process takes between being chosen and being bound starts on new ports."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from rewind.infra.drills import servers
from rewind.infra.net import LOOPBACK


def test_a_server_that_never_answers_is_stopped_with_its_children_before_the_error(tmp_path):  # type: ignore[no-untyped-def]
    server = servers.Spawned()
    script = "sleep 300 & echo $! > child; wait"  # a child in its group, as a server's workers are
    with pytest.raises(servers.TransientError, match="did not answer within"):
        server.spawn(
            ["sh", "-c", script],
            dict(os.environ),
            tmp_path / "log",
            lambda: False,
            "a mute server",
            2,
            cwd=tmp_path,
        )
    assert server.proc is None
    child = int((tmp_path / "child").read_text())
    assert not _running(child), "the server's child outlived the failed start"


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no reaper has collected yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(bool(servers.missing("seaweedfs")), reason="no weed binary")
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
