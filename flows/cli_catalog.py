"""`rewind catalog rebuild` and `rewind catalog check`: the catalog against the manifests on storage."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

TIERS = ["local", "shared", "offsite"]


def cmd_rebuild(args: argparse.Namespace, emit: Callable[..., None], catalog: Callable[[], Any]) -> int:
    from infra.inventory.rebuild import rebuild

    got = rebuild(catalog(), args.source, tier=args.tier, run=args.run, deep=not args.quick)

    def text() -> str:
        lines = [f"{p.action:14} {p.run} step {p.step} ({p.status}) <- {p.key}" for p in got.placed]
        lines += [f"not imported   {r.key}: {r.reason}" for r in got.refused]
        lines.append(
            f"{got.tier} tier {got.uri}: {len(got.placed)} copies placed, {len(got.refused)} not imported"
            + (f", {got.unsigned} on the tier's word alone (no manifest key configured)" if got.unsigned else "")
        )
        return "\n".join(lines)

    emit(args, got.as_dict(), text)
    return 1 if got.refused else 0


def cmd_check(args: argparse.Namespace, emit: Callable[..., None], catalog: Callable[[], Any]) -> int:
    from infra.inventory.drift import check

    found = check(catalog(), args.source, tier=args.tier, run=args.run, deep=args.deep)

    def text() -> str:
        lines = [f"{f.kind.value:18} {f.tier:8} {f.where}: {f.detail}" for f in found]
        return "\n".join([*lines, f"{len(found)} finding(s)"])

    emit(args, [f.as_dict() for f in found], text)
    return 1 if found else 0


def register(
    sub: Any,
    add: Callable[..., argparse.ArgumentParser],
    wrap: Callable[[Callable[..., int]], Callable[[argparse.Namespace], int]],
) -> None:
    cg = sub.add_parser("catalog", help="the catalog against storage: rebuild, check").add_subparsers(
        dest="catalog_command", required=True, metavar="ACTION"
    )
    rb = add(
        cg,
        "rebuild",
        wrap(cmd_rebuild),
        "recreate runs, checkpoints, lineage and copies from the manifests on a tier (exit 1 if any "
        "copy could not be imported)",
        json_flag=True,
    )
    rb.add_argument("--from", dest="source", required=True, help="s3://bucket/prefix or a path")
    rb.add_argument("--tier", choices=TIERS, help="what the tier is (default: from the URI)")
    rb.add_argument("--run", help="only this run")
    rb.add_argument("--quick", action="store_true", help="check sizes only, do not re-hash every byte")
    ck = add(
        cg,
        "check",
        wrap(cmd_check),
        "compare the catalog with storage both ways (exit 1 on any finding)",
        json_flag=True,
    )
    ck.add_argument("--from", dest="source", help="only this tier (default: every tier the catalog uses)")
    ck.add_argument("--tier", choices=TIERS, help="what the tier is (default: from the URI)")
    ck.add_argument("--run", help="only this run")
    ck.add_argument("--deep", action="store_true", help="re-hash every byte, not only sizes and manifests")
