"""The ``rewind`` command line.

Errors print one line and exit non-zero (2: bad input or state, 3: the catalog, a
tier or the model server cannot be reached, or a checkpoint's copies cannot be
checked, right now; 1: a check found problems; 70: a bug in Rewind); there is no traceback unless
``REWIND_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rewind.flows.cli_args import (
    EXIT_FINDINGS,
    EXIT_INTERNAL,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    OneLineParser,
    amount,
)
from rewind.flows.cli_output import table
from rewind.flows.cli_server import cmd_server
from rewind.infra.errors import RewindError, Stopped, is_transient

EXIT_TERMINATED = 128 + signal.SIGTERM
STOP_S = 10.0  # after SIGTERM the process is gone within this, cleaned up or not (Kubernetes waits 30 s)


class Terminated(BaseException):
    """SIGTERM arrived: unwind (finally blocks; a rollout puts the traffic back) and exit.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` retry or poll loop swallows it.
    """


def _on_sigterm(signum: int, frame: Any) -> None:
    """Commands that wait cooperatively (the serving flows) are asked to stop at their next wait, where
    they can clean up; any other is interrupted where it is. Either way the deadline stands."""
    from rewind.infra import stopping

    if stopping.requested():
        return  # a second SIGTERM does not interrupt the clean-up
    stopping.request()
    threading.Thread(target=_hard_stop, name="rewind-sigterm-deadline", daemon=True).start()
    if not getattr(_on_sigterm, "cooperative", False):
        raise Terminated()


def _off_the_main_thread(args: argparse.Namespace) -> int:
    """Run a cooperative command in a thread of its own: the main thread keeps SIGTERM to itself (a flow
    run on the main thread would install Prefect's handler, which raises wherever the flow happens to
    be, a catalog write included) and turns it into a stop request the command answers at its next wait."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["rc"] = args.fn(args)
        except BaseException as exc:  # handed to the main thread, which reports it
            box["exc"] = exc

    worker = threading.Thread(target=work, name="rewind-command", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
    if "exc" in box:
        raise box["exc"]
    return int(box["rc"])


def _hard_stop() -> None:
    """The deadline: whatever the unwinding still waits for, the process ends within ``STOP_S``."""
    time.sleep(STOP_S - 0.5)
    print(
        f"rewind: stopped by SIGTERM; clean-up did not finish within {STOP_S:g}s", file=sys.stderr, flush=True
    )
    os._exit(EXIT_TERMINATED)


def _catalog() -> Any:
    from rewind.infra.catalog.db import Catalog

    return Catalog()


def _emit(args: argparse.Namespace, rows: Any, text: Callable[[], str]) -> None:
    print(json.dumps(rows, indent=1, default=str) if args.json else text())


# -- db -----------------------------------------------------------------------


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.errors import MissingDatabase

    cat = Catalog(auto_upgrade=False)
    try:
        cat.migrate(args.revision)
    except MissingDatabase:  # a first upgrade against a server without the database: make it, then go on
        if cat.create_database():
            print(f"created the database {cat.url.database!r} for catalog {cat.safe_url}")
        cat.migrate(args.revision)
    print(f"catalog {cat.safe_url} at revision {cat.current()}")
    return 0


def cmd_db_downgrade(args: argparse.Namespace) -> int:
    from rewind.infra.catalog.db import Catalog

    cat = Catalog(auto_upgrade=False)
    cat.migrate(args.revision, down=True)
    print(f"catalog {cat.safe_url} at revision {cat.current()}")
    return 0


def cmd_db_current(args: argparse.Namespace) -> int:
    from rewind.infra.catalog.db import Catalog

    cat = Catalog(auto_upgrade=False)
    row = {"url": cat.safe_url, "current": cat.current(), "head": cat.head()}
    _emit(args, row, lambda: f"{row['url']}: revision {row['current']} (head {row['head']})")
    return 0


def cmd_gpu(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from rewind.infra.health import nvml

    gpus = nvml.probe()
    rows = [asdict(g) | {"healthy": g.healthy} for g in gpus]
    _emit(
        args,
        rows,
        lambda: table(rows, ["index", "name", "temperature_c", "ecc_uncorrected", "healthy", "problems"]),
    )
    return 0 if all(g.healthy for g in gpus) else EXIT_FINDINGS


# -- prefect ---------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from rewind.flows.deployments import serve_all
    from rewind.flows.serve_guard import require_authenticating_api

    require_authenticating_api(allow_unauthenticated=args.allow_unauthenticated_api)

    serve_all(
        scrub_every=timedelta(seconds=args.scrub_every),
        replicate_every=timedelta(seconds=args.replicate_every),
        replicate_to=args.replicate_to,
    )
    return 0


# -- parser ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="rewind",
        description="Workflow-orchestrated rollback for AI training and model serving.",
        epilog="Catalog: REWIND_CATALOG_URL (default sqlite under REWIND_HOME, ~/.rewind).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        parent: Any, name: str, fn: Callable[[argparse.Namespace], int], help: str, json_flag: bool = False
    ) -> argparse.ArgumentParser:
        sp = parent.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    db = sub.add_parser("db", help="catalog schema").add_subparsers(
        dest="db_command", required=True, metavar="ACTION"
    )
    up = add(db, "upgrade", cmd_db_upgrade, "apply migrations (default: to the newest)")
    up.add_argument("revision", nargs="?", default="head")
    down = add(db, "downgrade", cmd_db_downgrade, "revert migrations to REVISION ('base' removes everything)")
    down.add_argument("revision")
    add(db, "current", cmd_db_current, "show the catalog's revision", json_flag=True)

    from rewind.flows import cli_ckpt

    ck = cli_ckpt.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_storage

    cli_storage.register(sub, ck, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_catalog

    cli_catalog.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_drill

    cli_drill.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_run

    cli_run.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_kubernetes

    cli_kubernetes.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_serving

    cli_serving.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_status

    cli_status.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_metrics

    cli_metrics.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from rewind.flows import cli_logs

    cli_logs.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    _add_machine_commands(sub, add)
    return p


def _add_machine_commands(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """`rewind gpu`, `rewind serve` and `rewind server`: this machine's GPUs, worker and Prefect server."""
    add(
        sub,
        "gpu",
        cmd_gpu,
        "GPU health through NVML: temperature, ECC, remapped rows, throttling",
        json_flag=True,
    )
    srv = add(sub, "serve", cmd_serve, "serve every Rewind deployment (schedules and the recovery trigger)")
    srv.add_argument(
        "--scrub-every", type=amount, default=6 * 3600, metavar="SECONDS", help="deep verification interval"
    )
    srv.add_argument(
        "--replicate-every", type=amount, default=900, metavar="SECONDS", help="replication interval"
    )
    srv.add_argument(
        "--replicate-to",
        "--shared-target",  # the old name, kept working
        dest="replicate_to",
        help="target of replicate-offsite: s3://bucket/prefix or a shared path (default REWIND_OFFSITE_URI)",
    )
    srv.add_argument(
        "--allow-unauthenticated-api",
        action="store_true",
        help="serve from a Prefect API that lets anyone in (only where something else guards it)",
    )
    ui = add(sub, "server", cmd_server, "start the Prefect server and UI (bound to 127.0.0.1 by default)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=None, help="default: PREFECT_SERVER_API_PORT, else 4200")
    ui.add_argument("--no-auth", action="store_true", help="serve the API without basic auth (not advised)")


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("REWIND_LOG_LEVEL", "WARNING"), format="%(name)s: %(message)s")
    if "REWIND_LOG_LEVEL" not in os.environ:
        from rewind.flows import prefect_noise

        prefect_noise.quiet()
    argv = list(sys.argv[1:] if argv is None else argv)
    if bad := _not_utf8(argv):
        print(f"rewind: error: argument {bad} is not valid UTF-8 (names must be text)", file=sys.stderr)
        return EXIT_USAGE
    args = build_parser().parse_args(argv)
    previous = None
    if threading.current_thread() is threading.main_thread():
        # `rewind serve`: Prefect's runner takes over once it runs
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        _on_sigterm.cooperative = getattr(args, "cooperative", False)  # type: ignore[attr-defined]
    try:
        return _dispatch(args)
    finally:
        if previous is not None:  # main() called in-process (tests): leave the caller's handler as it was
            signal.signal(signal.SIGTERM, previous)


def _not_utf8(argv: Sequence[str]) -> int | None:
    """The 1-based position of the first argument the OS gave as bytes that are not UTF-8, if any."""
    for i, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return i
    return None


def _dispatch(args: argparse.Namespace) -> int:
    try:
        from rewind.flows import server_auth

        server_auth.use_in_clients()  # before anything talks to a Prefect server
        if getattr(args, "cooperative", False):
            return _off_the_main_thread(args)
        return args.fn(args)
    except (Terminated, Stopped):
        print("rewind: stopped by SIGTERM", file=sys.stderr, flush=True)
        return EXIT_TERMINATED
    except KeyboardInterrupt:  # what was sent is kept: a re-run resumes it, nothing half-done is registered
        print("rewind: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): as a shell reports a process SIGPIPE ended
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + signal.SIGPIPE
    except Exception as exc:
        from rewind.infra import stopping

        if stopping.requested():  # SIGTERM came first: a library may have wrapped Terminated (pydantic does)
            print("rewind: stopped by SIGTERM", file=sys.stderr, flush=True)
            return EXIT_TERMINATED
        if is_transient(exc):  # the catalog, a tier, the model server: unreachable right now
            print(f"rewind: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        if isinstance(exc, RewindError):
            print(f"rewind: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
        if os.environ.get("REWIND_DEBUG"):
            raise
        print(
            f"rewind: internal error (a bug in Rewind): {type(exc).__name__}: {_one_line(exc)}; "
            "REWIND_DEBUG=1 shows the traceback",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 1000 else text[:997] + "..."


if __name__ == "__main__":
    sys.exit(main())
