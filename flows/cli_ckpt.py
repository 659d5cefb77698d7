"""`rewind runs list` and `rewind ckpt list|show|verify`: what the catalog holds of runs and checkpoints."""

from __future__ import annotations

import argparse
from typing import Any

from rewind.flows.cli_args import (
    EXIT_FINDINGS,
    EXIT_UNAVAILABLE,
    Add,
    Emit,
    OpenCatalog,
    Wrap,
    amount,
    at_least_one,
    step,
)
from rewind.flows.cli_output import table
from rewind.infra.errors import RewindError


def cmd_runs_list(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.catalog import lineage

    rows = lineage.list_runs(catalog())
    emit(args, rows, lambda: table(rows, ["run", "latest_step", "verified_checkpoints", "created_at"]))
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


LIST_LIMIT = 50  # the text listing's default page: a terminal is no place for a run's every checkpoint


def cmd_ckpt_list(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.catalog import lineage

    limit = None if args.all or (args.json and args.limit is None) else (args.limit or LIST_LIMIT)
    total, found = lineage.listing(catalog(), args.run, limit)
    rows = [_ckpt_row(ck) for ck in found]
    cols = ["id", "step", "status", "parent_id", "bytes", "loss", "stall_s", "reason"]

    def text() -> str:
        more = len(rows) < total
        return table(rows, cols) + (
            f"\n(the newest {len(rows)} of {total} checkpoints; --limit N or --all for more)" if more else ""
        )

    emit(args, rows, text)
    return 0


def cmd_ckpt_show(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.catalog import lineage

    cat = catalog()
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
            parts.append(table(row["files"], ["path", "size", "xxh3", "crc32c"]))
            parts.append(table(row["replicas"], ["tier", "status", "verified_at", "uri", "detail"]))
        return "\n\n".join(parts)

    emit(args, out if len(out) > 1 else out[0], text)
    return 0


def cmd_ckpt_verify(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.flows import progress_view
    from rewind.flows.cli_notify import cli_notifier
    from rewind.infra.format.verify import Budget
    from rewind.infra.phases.verify import verify_run

    with progress_view.shown():
        found = verify_run(
            catalog(),
            run=args.run,
            notify=cli_notifier(),
            step=args.step,
            deep=args.deep,
            tiers=None if args.tier is None else (args.tier,),
            budget=Budget() if args.budget_s is None else Budget(seconds=args.budget_s),
        )
    results = [{"id": r.checkpoint_id, **r.as_dict()} for r in found]  # "id": as before the phase layer
    emit(args, results, lambda: _verify_text(results))
    shown = [r.as_dict() for r in found]
    if any(_has_problems(r) for r in shown):
        return EXIT_FINDINGS
    # Only doubt is left (a copy unreadable right now, an unknown key, the budget spent before it):
    # nothing was found wrong; check again later.
    return EXIT_UNAVAILABLE if any(not r["ok"] for r in shown) else 0


def _has_problems(result: dict[str, Any]) -> bool:
    """Something found wrong: a copy damaged or missing, or no copy at all (not mere doubt)."""
    verdicts = [c["verdict"] for c in result["copies"]]
    return (not verdicts and not result.get("elsewhere")) or any(
        v in ("corrupt", "missing") for v in verdicts
    )


def _verify_text(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        mode = "deep" if r["deep"] else "quick"
        verdict = (
            "ok"
            if r["ok"]
            else "PROBLEMS"
            if _has_problems(r)
            else "UNCHECKED"
            if r["unchecked"]
            else "NOT PROVEN NOW"
        )
        lines.append(f"step {r['step']}: {verdict} ({mode}), checkpoint {r['status']}")
        for c in r["copies"]:
            lines.append(
                f"  {c['tier']:8} {c['verdict'].upper() if c['verdict'] != 'verified' else 'ok'}  {c['where']}"
            )
            lines += [f"    {f['path']}: {f['problem']}: {f['detail']}" for f in c["findings"]]
        lines += [
            f"  local    on a disk of host {h} not seen here: checked where it is seen"
            for h in r.get("elsewhere", [])
        ]
    unchecked = sum(r["unchecked"] > 0 for r in results)
    bad = sum(_has_problems(r) for r in results)
    tail = f", {unchecked} not reached before the budget ran out (--budget-s)" if unchecked else ""
    doubt = sum(not r["ok"] and not _has_problems(r) for r in results) - unchecked
    tail += f", {doubt} not provable right now (unreadable, or an unknown key)" if doubt > 0 else ""
    lines.append(f"{len(results) - unchecked} checked, {bad} with problems{tail}")
    return "\n".join(lines)


def register(
    sub: Any,
    add: Add,
    wrap: Wrap,
) -> Any:
    """The `runs` and `ckpt` commands; returns the `ckpt` subparsers, where more checkpoint commands go."""
    runs = sub.add_parser("runs", help="training runs").add_subparsers(
        dest="runs_command", required=True, metavar="ACTION"
    )
    add(runs, "list", wrap(cmd_runs_list), "list runs with their newest checkpoint", json_flag=True)

    ck = sub.add_parser("ckpt", help="checkpoints of a run").add_subparsers(
        dest="ckpt_command", required=True, metavar="ACTION"
    )
    ls = add(
        ck, "list", wrap(cmd_ckpt_list), "list a run's checkpoints with status and lineage", json_flag=True
    )
    ls.add_argument("run")
    page = ls.add_mutually_exclusive_group()
    page.add_argument(
        "--limit",
        type=at_least_one,
        default=None,
        help=f"only the newest N (default: {LIST_LIMIT} in the text output, every one with --json)",
    )
    page.add_argument("--all", action="store_true", help="every checkpoint of the run")
    show = add(
        ck,
        "show",
        wrap(cmd_ckpt_show),
        "show one checkpoint: files, digests, replicas, environment",
        json_flag=True,
    )
    show.add_argument("run")
    show.add_argument("step", type=step)
    ver = add(
        ck,
        "verify",
        wrap(cmd_ckpt_verify),
        "check every copy against the catalog's manifest digest (exit 1 on damage, 3 if not provable now)",
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
    ver.add_argument(
        "--budget-s",
        type=amount,
        default=None,
        metavar="SECONDS",
        help="stop reading after this long; what is left is reported unchecked, exit 3 (default 6 h)",
    )
    return ck
