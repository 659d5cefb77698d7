"""`rewind catalog rebuild`, `rewind catalog check`, `rewind adopt`: the catalog against what lies on storage."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap, step

TIERS = ["local", "shared", "offsite"]
FORMATS = ["dcp", "torchtitan", "hf-trainer", "safetensors"]


def cmd_rebuild(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.inventory.rebuild import rebuild

    got = rebuild(catalog(), args.source, tier=args.tier, run=args.run, deep=not args.quick)

    def text() -> str:
        lines = [f"{p.action:14} {p.run} step {p.step} ({p.status}) <- {p.key}" for p in got.placed]
        lines += [f"not imported   {r.key}: {r.reason}" for r in got.refused]
        lines.append(
            f"{got.tier} tier {got.uri}: {len(got.placed)} copies placed, {len(got.refused)} not imported"
            + (
                f", {got.unsigned} on the tier's word alone (no manifest key configured)"
                if got.unsigned
                else ""
            )
        )
        return "\n".join(lines)

    emit(args, got.as_dict(), text)
    return 1 if got.refused else 0


def cmd_check(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.errors import ConfigError
    from rewind.infra.inventory.drift import check

    if args.tier and not args.source:
        raise ConfigError("--tier says what the --from URI is: give --from too")
    found = check(catalog(), args.source, tier=args.tier, run=args.run, deep=args.deep)

    def text() -> str:
        lines = [f"{f.kind.value:18} {f.tier:8} {f.where}: {f.detail}" for f in found]
        return "\n".join([*lines, f"{len(found)} finding(s)"])

    emit(args, [f.as_dict() for f in found], text)
    return 1 if found else 0


def cmd_adopt(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from pathlib import Path

    from rewind.infra.inventory.adopt import adopt

    got = adopt(catalog(), Path(args.path), run=args.run, step=args.step, fmt=args.format)

    def text() -> str:
        return (
            f"{got.action}: {got.path} as run {got.run} step {got.step} ({got.format}, {got.files} files, "
            f"{got.bytes} bytes, pinned); verify, replicate and restore now protect it"
        )

    emit(args, dataclasses.asdict(got), text)
    return 0


def register(
    sub: Any,
    add: Add,
    wrap: Wrap,
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
    ad = add(
        sub,
        "adopt",
        wrap(cmd_adopt),
        "take a checkpoint directory Rewind did not write under protection: hash every file, write a "
        "manifest beside them, register it (pinned)",
        json_flag=True,
    )
    ad.add_argument(
        "path", help="the checkpoint directory (DCP, TorchTitan step-N, HF checkpoint-N, safetensors)"
    )
    ad.add_argument("--run", required=True, help="the run it belongs to (created if new)")
    ad.add_argument("--step", type=step, help="default: from the directory's name or trainer_state.json")
    ad.add_argument("--format", choices=FORMATS, help="default: detected from the files")
