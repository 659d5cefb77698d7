"""`rewind metrics serve [--host 127.0.0.1] [--port 9464]`: the catalog's Prometheus metrics over HTTP
(rewind.infra.metrics), read at each scrape, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 9464  # 9464: the port exporters of this kind commonly use


def cmd_serve(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.errors import ConfigError, is_transient

    try:
        from prometheus_client import start_http_server

        from rewind.infra import metrics
    except ImportError as exc:  # an optional extra: the rest of the CLI works without it
        raise ConfigError(f"{exc}: install the metrics extra (pip install 'rewind[metrics]')") from exc

    try:
        first = catalog()  # a bad URL or an old schema is an error now, not at every scrape
    except Exception as exc:
        if not is_transient(exc):
            raise
        print(f"rewind: catalog not reachable yet ({exc}); serving rewind_catalog_up 0 until it is",
              file=sys.stderr, flush=True)  # fmt: skip
        first = None
    opened = [first]

    def open_catalog() -> Any:
        if opened[0] is None:
            opened[0] = catalog()
        return opened[0]

    try:
        server, thread = start_http_server(args.port, addr=args.host, registry=metrics.registry(open_catalog))
    except OSError as exc:  # the port is taken, the address is not this machine's
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    try:
        host, port = str(server.server_address[0]), int(server.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        where = first.safe_url if first is not None else "(not reachable yet)"
        print(f"serving Prometheus metrics of catalog {where} on http://{shown}:{port}/metrics", flush=True)
        threading.Event().wait()  # until SIGTERM (the CLI's handler raises here) or Ctrl-C
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    return 0


def register(
    sub: Any,
    add: Add,
    wrap: Wrap,
) -> None:
    mt = sub.add_parser("metrics", help="Prometheus metrics of the catalog").add_subparsers(
        dest="metrics_command", required=True, metavar="ACTION"
    )
    sv = add(
        mt,
        "serve",
        wrap(cmd_serve),
        "serve /metrics for Prometheus: per run the newest committed and verified checkpoint's age, save "
        "stall, bytes and replication lag per tier; incidents and RTO by kind; drill verdicts and RTO per "
        "scenario; read from the catalog at each scrape, until SIGTERM or Ctrl-C",
    )
    sv.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}: this machine only; the endpoint has no "
        "authentication, so bind another address only on a network you trust)",
    )
    sv.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)"
    )


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a whole number, not {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535, not {text}")
    return n
