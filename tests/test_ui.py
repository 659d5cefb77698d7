"""Which API the Prefect UI of `rewind server --port N` calls (the browser test is in test_flows.py).

Left to Prefect, the UI's pages call ``PREFECT_API_URL`` (or port 4200), not the port the server was
started on, and every page says "Can't connect to Server API".
"""

from __future__ import annotations

import pytest
from prefect.settings import Settings

from rewind.flows.cli_server import ui_api_url


def test_the_ui_calls_the_servers_own_port_whatever_prefect_api_url_says(monkeypatch):
    monkeypatch.delenv("PREFECT_UI_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_SERVER_UI_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert ui_api_url("127.0.0.1", 4311, Settings()) == ("http://127.0.0.1:4311/api", "own")
    assert ui_api_url("::1", 4311, Settings()) == ("http://[::1]:4311/api", "own")
    assert ui_api_url("0.0.0.0", 4311, Settings()) == ("http://127.0.0.1:4311/api", "wildcard")


@pytest.mark.parametrize("name", ["PREFECT_UI_API_URL", "PREFECT_SERVER_UI_API_URL"])
def test_an_explicit_ui_api_url_is_kept(name, monkeypatch):
    """Behind a reverse proxy the browser reaches the API at another address: the operator says which."""
    monkeypatch.setenv(name, "https://rewind.example.org/api")
    assert ui_api_url("127.0.0.1", 4311, Settings()) == ("https://rewind.example.org/api", "given")
