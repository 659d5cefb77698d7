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

from flows.cli_args import OneLineParser, amount, step
from infra.errors import RewindError, Stopped, TransientError

EXIT_FINDINGS, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERNAL = 1, 2, 3, 70
EXIT_TERMINATED = 128 + signal.SIGTERM
STOP_S = 5.0  # after SIGTERM the process is gone within this, cleaned up or not


class Terminated(BaseException):
    """SIGTERM arrived: unwind (finally blocks; a rollout puts the traffic back) and exit.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` retry or poll loop swallows it.
    """


def _on_sigterm(signum: int, frame: Any) -> None:
    """Commands that wait cooperatively (the serving flows) are asked to stop at their next wait, where
    they can clean up; any other is interrupted where it is. Either way the deadline stands."""
    from infra import stopping

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
    from infra.catalog.db import Catalog

    return Catalog()


def _emit(args: argparse.Namespace, rows: Any, text: Callable[[], str]) -> None:
    print(json.dumps(rows, indent=1, default=str) if args.json else text())


def _table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


# -- db -----------------------------------------------------------------------


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from infra.catalog.db import Catalog

    cat = Catalog(auto_upgrade=False)
    cat.migrate(args.revision)
    print(f"catalog {cat.safe_url} at revision {cat.current()}")
    return 0


def cmd_db_downgrade(args: argparse.Namespace) -> int:
    from infra.catalog.db import Catalog

    cat = Catalog(auto_upgrade=False)
    cat.migrate(args.revision, down=True)
    print(f"catalog {cat.safe_url} at revision {cat.current()}")
    return 0


def cmd_db_current(args: argparse.Namespace) -> int:
    from infra.catalog.db import Catalog

    cat = Catalog(auto_upgrade=False)
    row = {"url": cat.safe_url, "current": cat.current(), "head": cat.head()}
    _emit(args, row, lambda: f"{row['url']}: revision {row['current']} (head {row['head']})")
    return 0


# -- runs / ckpt ----------------------------------------------------------------


def cmd_runs_list(args: argparse.Namespace) -> int:
    from infra.catalog import lineage

    rows = lineage.list_runs(_catalog())
    _emit(args, rows, lambda: _table(rows, ["run", "latest_step", "verified_checkpoints", "created_at"]))
    return 0


def _ckpt_row(ck: Any) -> dict[str, Any]:
    return {
        "id": ck.id,
        "step": ck.step,
        "status": ck.status,
        "parent_id": ck.parent_id,
        "bytes": ck.total_bytes,
        "manifest_digest": ck.manifest_digest,
        "loss": (ck.metrics or {}).get("loss"),
        "stall_s": None if ck.save_stall_s is None else round(ck.save_stall_s, 4),
        "pinned": ck.pinned,
        "created_at": ck.created_at.isoformat(),
        "reason": ck.status_reason,
        "path": ck.path,
    }


def cmd_ckpt_list(args: argparse.Namespace) -> int:
    from infra.catalog import lineage

    rows = [_ckpt_row(ck) for ck in lineage.checkpoints(_catalog(), args.run)]
    cols = ["id", "step", "status", "parent_id", "bytes", "loss", "stall_s", "reason"]
    _emit(args, rows, lambda: _table(rows, cols))
    return 0


def cmd_ckpt_show(args: argparse.Namespace) -> int:
    from infra.catalog import lineage

    cat = _catalog()
    found = lineage.checkpoints(cat, args.run, args.step)
    if not found:
        raise RewindError(f"run {args.run!r} has no checkpoint at step {args.step}")
    out = []
    for ck in found:
        row = _ckpt_row(ck)
        row["layout"], row["environment"] = ck.layout, ck.environment
        row["files"] = [
            {"path": f.path, "size": f.size, "xxh3": f.xxh3, "crc32c": f.crc32c}
            for f in lineage.files_of(cat, ck.id)
        ]
        row["replicas"] = [
            {
                "tier": r.tier,
                "uri": r.uri if r.key is None else f"{r.uri.rstrip('/')}/{r.key}",
                "status": r.status,
                "verified_at": lineage.iso(r.verified_at),
                "detail": r.detail,
            }
            for r in lineage.replicas_of(cat, ck.id)
        ]
        out.append(row)

    def text() -> str:
        parts = []
        for row in out:
            head = {k: v for k, v in row.items() if k not in ("files", "replicas", "environment")}
            parts.append("\n".join(f"{k:16} {v}" for k, v in head.items()))
            parts.append(_table(row["files"], ["path", "size", "xxh3", "crc32c"]))
            parts.append(_table(row["replicas"], ["tier", "status", "verified_at", "uri", "detail"]))
        return "\n\n".join(parts)

    _emit(args, out if len(out) > 1 else out[0], text)
    return 0


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    from flows import progress_view
    from infra.catalog import lineage
    from infra.restore.scrub import scrub

    cat = _catalog()
    targets = [
        ck
        for ck in lineage.checkpoints(cat, args.run, args.step)
        if ck.status in ("committed", "verified", "corrupt")
    ]
    if not targets:
        raise RewindError(
            f"run {args.run!r} has no committed checkpoint"
            + (f" at step {args.step}" if args.step is not None else "")
        )
    tiers = None if args.tier is None else (args.tier,)
    results = []
    for ck in targets:
        with progress_view.shown():
            check = scrub(cat, ck, deep=args.deep, tiers=tiers)
        if not check.copies and ck.status == "corrupt":
            continue  # condemned earlier and nothing left to look at: history, not news
        results.append(
            {
                "step": ck.step,
                "id": ck.id,
                "ok": check.ok,
                "status": check.status,
                "deep": args.deep,
                "path": ck.path,
                "copies": [
                    {
                        "tier": c.tier,
                        "where": c.where,
                        "verdict": c.verdict.value,
                        "findings": [f.as_dict() for f in c.findings],
                    }
                    for c in check.copies
                ],
                "findings": [f.as_dict() for f in check.findings],
            }
        )
    if not results:
        raise RewindError(
            f"run {args.run!r} has no copy" + (f" on the {args.tier} tier" if args.tier else "") + " to check"
        )
    _emit(args, results, lambda: _verify_text(results))
    return EXIT_FINDINGS if any(not r["ok"] for r in results) else 0


def _verify_text(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        mode = "deep" if r["deep"] else "quick"
        lines.append(
            f"step {r['step']}: {'ok' if r['ok'] else 'PROBLEMS'} ({mode}), checkpoint {r['status']}"
        )
        for c in r["copies"]:
            lines.append(
                f"  {c['tier']:8} {c['verdict'].upper() if c['verdict'] != 'verified' else 'ok'}  {c['where']}"
            )
            lines += [f"    {f['path']}: {f['problem']}: {f['detail']}" for f in c["findings"]]
    bad = sum(not r["ok"] for r in results)
    lines.append(f"{len(results)} checked, {bad} with problems")
    return "\n".join(lines)


def cmd_gpu(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from infra.health import nvml

    gpus = nvml.probe()
    rows = [asdict(g) | {"healthy": g.healthy} for g in gpus]
    _emit(
        args,
        rows,
        lambda: _table(rows, ["index", "name", "temperature_c", "ecc_uncorrected", "healthy", "problems"]),
    )
    return 0 if all(g.healthy for g in gpus) else EXIT_FINDINGS


# -- prefect ---------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from flows.deployments import serve_all

    serve_all(
        scrub_every=timedelta(seconds=args.scrub_every),
        replicate_every=timedelta(seconds=args.replicate_every),
        replicate_to=args.replicate_to,
    )
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    from flows import server_auth

    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", args.host, "--port", str(args.port)]
    env = dict(os.environ)
    if args.no_auth:
        env.pop(server_auth.SERVER_ENV, None)
        how = "no authentication (--no-auth): anyone who reaches the port can run flows"
    else:
        env[server_auth.SERVER_ENV] = server_auth.ensure()
        how = f"basic auth on; the credential is in {server_auth.path()} (mode 0600), used by this user's clients"
    ui_api, ui_how = ui_api_url(args.host, args.port)
    if ui_how != "given":
        env[UI_API_ENV] = ui_api
    print(f"starting the Prefect server and UI on {args.host}:{args.port}, {how}", flush=True)
    print(f"the UI calls the API at {ui_api} ({UI_HOW[ui_how]})", flush=True)
    os.execve(cmd[0], cmd, env)
    return 0


UI_API_ENV = "PREFECT_SERVER_UI_API_URL"  # Prefect 3 (PREFECT_UI_API_URL is its older alias)
UI_HOW = {
    "given": "set explicitly: PREFECT_UI_API_URL, PREFECT_SERVER_UI_API_URL or the Prefect profile",
    "own": "this server's own host and port; PREFECT_UI_API_URL overrides it",
    "wildcard": "the server listens on every address: browsers on other machines need "
    "PREFECT_UI_API_URL set to the address they reach",
}


def ui_api_url(host: str, port: int, settings: Any = None) -> tuple[str, str]:
    """The API URL the UI's pages are told to call, and why: ``given`` (an explicit Prefect setting),
    ``own`` (this server's host and port) or ``wildcard`` (loopback, for a server bound to every address).

    Left alone, Prefect's UI calls ``PREFECT_API_URL`` or the default port 4200, not the port the server
    was started on: every page would say it cannot connect to the server API.
    """
    from prefect.settings import get_current_settings

    ui = (settings or get_current_settings()).server.ui
    if "api_url" in ui.model_fields_set and ui.api_url:  # env (either name), profile or prefect.toml
        return ui.api_url, "given"
    wildcard = host in ("", "0.0.0.0", "::", "[::]")
    name = "127.0.0.1" if wildcard else host
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"  # an IPv6 address in a URL
    return f"http://{name}:{port}/api", "wildcard" if wildcard else "own"


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

    runs = sub.add_parser("runs", help="training runs").add_subparsers(
        dest="runs_command", required=True, metavar="ACTION"
    )
    add(runs, "list", cmd_runs_list, "list runs with their newest checkpoint", json_flag=True)

    ck = sub.add_parser("ckpt", help="checkpoints of a run").add_subparsers(
        dest="ckpt_command", required=True, metavar="ACTION"
    )
    ls = add(ck, "list", cmd_ckpt_list, "list a run's checkpoints with status and lineage", json_flag=True)
    ls.add_argument("run")
    show = add(
        ck,
        "show",
        cmd_ckpt_show,
        "show one checkpoint: files, digests, replicas, environment",
        json_flag=True,
    )
    show.add_argument("run")
    show.add_argument("step", type=step)
    ver = add(
        ck,
        "verify",
        cmd_ckpt_verify,
        "check every copy against the catalog's manifest digest (exit 1 on any problem)",
        json_flag=True,
    )
    ver.add_argument("run")
    ver.add_argument("--step", type=step, help="only this step (default: every committed checkpoint)")
    ver.add_argument("--deep", action="store_true", help="re-read and re-hash every byte, not only sizes")
    ver.add_argument(
        "--tier",
        choices=["local", "shared", "offsite"],
        default=None,
        help="only the copies on this tier (default: every copy); offsite quick compares server-side "
        "checksums without downloading",
    )
    from flows import cli_storage

    cli_storage.register(sub, ck, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from flows import cli_catalog

    cli_catalog.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from flows import cli_drill

    cli_drill.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from flows import cli_serving

    cli_serving.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
    from flows import cli_status

    cli_status.register(sub, add, lambda fn: lambda args: fn(args, _emit, _catalog))
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
    ui = add(sub, "server", cmd_server, "start the Prefect server and UI (bound to 127.0.0.1 by default)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=4200)
    ui.add_argument("--no-auth", action="store_true", help="serve the API without basic auth (not advised)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("REWIND_LOG_LEVEL", "WARNING"), format="%(name)s: %(message)s")
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


def _dispatch(args: argparse.Namespace) -> int:
    try:
        from flows import server_auth

        server_auth.use_in_clients()  # before anything talks to a Prefect server
        if getattr(args, "cooperative", False):
            return _off_the_main_thread(args)
        return args.fn(args)
    except (Terminated, Stopped):
        print("rewind: stopped by SIGTERM", file=sys.stderr, flush=True)
        return EXIT_TERMINATED
    except TransientError as exc:  # the catalog, a tier, the model server: unreachable right now
        print(f"rewind: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except RewindError as exc:
        print(f"rewind: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # what was sent is kept: a re-run resumes it, nothing half-done is registered
        print("rewind: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
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
