"""`rewind replicate`, `rewind ckpt restore`, `rewind ckpt pin`, `rewind gc`: checkpoints across tiers."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from infra.errors import RewindError

MiB = 1 << 20


def _tier_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part-size-mib", type=int, default=64, help="S3 multipart part size")
    p.add_argument("--concurrency", type=int, default=8, help="S3 parts in flight")
    p.add_argument(
        "--immutable-days", type=int, default=None, help="S3 Object Lock retention (bucket must allow it)"
    )


def _open(uri: str, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from infra.tiers import open_tier

    if uri.startswith("s3://"):
        return open_tier(
            uri,
            part_size=args.part_size_mib * MiB,
            concurrency=args.concurrency,
            immutable_days=args.immutable_days,
        )
    return open_tier(uri)


def cmd_replicate(args: argparse.Namespace, emit: Callable[..., None], catalog: Callable[[], Any]) -> int:
    import os

    from infra.catalog import lineage
    from infra.tiers import catalogued

    target = args.to or os.environ.get("REWIND_OFFSITE_URI") or os.environ.get("REWIND_SHARED_URI")
    if not target:
        raise RewindError("no target: pass --to s3://bucket/prefix (or a path), or set REWIND_OFFSITE_URI")
    cat = catalog()
    tier = _open(target, args)
    tier.check()
    rows = []
    for ck in lineage.without_replica(cat, tier.name, args.run):
        sent = catalogued.replicate_recorded(cat, ck, tier)
        rows.append({"step": ck.step, "bytes_sent": sent, "tier": tier.name, "uri": target})
        if not args.json:
            print(f"step {ck.step}: replicated to {target} ({sent} bytes sent)", flush=True)
    if args.json:
        emit(args, rows, lambda: "")
    elif not rows:
        print(
            f"nothing to replicate: every committed checkpoint of {args.run} has a verified copy on {target}"
        )
    return 0


def cmd_restore(args: argparse.Namespace, emit: Callable[..., None], catalog: Callable[[], Any]) -> int:
    from infra import config
    from infra.catalog import lineage
    from infra.tiers import catalogued

    cat = catalog()
    run = lineage.get_run(cat, args.run)
    candidates = [c for c in lineage.restorable(cat, run.id) if args.step is None or c.step == args.step]
    if not candidates:
        raise RewindError(
            f"run {args.run!r} has no committed checkpoint"
            + (f" at step {args.step}" if args.step is not None else "")
        )
    errors = []
    for ck in candidates:
        for rep in catalogued.remote_replicas(cat, ck.id):
            if args.source not in (None, rep.tier):
                continue
            try:
                path = catalogued.restore_to_local(cat, ck, rep, config.checkpoint_root())
            except RewindError as exc:
                errors.append(f"step {ck.step} from {rep.tier}: {exc}")
                continue
            row = {"step": ck.step, "from": rep.tier, "uri": rep.uri, "path": str(path)}
            emit(
                args,
                row,
                lambda row=row: (
                    f"restored step {row['step']} from {row['from']} ({row['uri']}) into {row['path']}"
                ),
            )
            return 0
    raise RewindError("no verified replica could be restored" + (": " + "; ".join(errors) if errors else ""))


def cmd_pin(args: argparse.Namespace, emit: Callable[..., None], catalog: Callable[[], Any]) -> int:
    from infra.catalog import lineage

    lineage.set_pinned(catalog(), args.run, args.step, not args.unpin)
    print(
        f"step {args.step} of {args.run} {'unpinned' if args.unpin else 'pinned: retention will never remove it'}"
    )
    return 0


def cmd_gc(args: argparse.Namespace, emit: Callable[..., None], catalog: Callable[[], Any]) -> int:
    from infra import retention

    cat = catalog()
    policy = retention.Policy(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        byte_budget=int(args.budget_gb * 1e9) if args.budget_gb is not None else None,
    )
    gc = retention.plan(cat, args.run, policy)
    removed = [] if args.dry_run else retention.execute(cat, gc)
    usage = retention.usage(cat, args.run, args.price_per_gb_month)
    out = {
        "run": args.run,
        "dry_run": args.dry_run,
        "keep": gc.keep,
        "remove": [{"step": r.step, "bytes": r.bytes, "copies": [t for t, _ in r.copies]} for r in gc.remove],
        "freed_bytes": gc.freed_bytes,
        "removed": removed,
        "usage": usage,
    }

    def text() -> str:
        verb = "would remove" if args.dry_run else "removed"
        lines = [f"keep steps {gc.keep}"]
        lines += [
            f"{verb} step {r.step} ({r.bytes} bytes x {len(r.copies)} copies: {', '.join(t for t, _ in r.copies)})"
            for r in gc.remove
        ]
        lines.append(f"{'would free' if args.dry_run else 'freed'} {gc.freed_bytes} bytes")
        lines += [f"{u['tier']:8} {u['gb']:10.3f} GB  ${u['usd_per_month']:.2f}/month" for u in usage]
        return "\n".join(lines)

    emit(args, out, text)
    return 0


def register(
    sub: Any,
    ck: Any,
    add: Callable[..., argparse.ArgumentParser],
    wrap: Callable[[Callable[..., int]], Callable[[argparse.Namespace], int]],
) -> None:
    rep = add(
        sub,
        "replicate",
        wrap(cmd_replicate),
        "copy a run's committed checkpoints to S3 or a shared path, verified",
        json_flag=True,
    )
    rep.add_argument("run")
    rep.add_argument("--to", help="s3://bucket/prefix or an absolute path (default REWIND_OFFSITE_URI)")
    _tier_options(rep)
    res = add(
        ck,
        "restore",
        wrap(cmd_restore),
        "download a checkpoint from a replica into the local tier",
        json_flag=True,
    )
    res.add_argument("run")
    res.add_argument("--step", type=int, help="default: the newest with a verified replica")
    res.add_argument("--from", dest="source", choices=["shared", "offsite"], help="default: the nearest tier")
    pin = add(ck, "pin", wrap(cmd_pin), "keep a checkpoint whatever the retention policy says")
    pin.add_argument("run")
    pin.add_argument("step", type=int)
    pin.add_argument("--unpin", action="store_true")
    gc = add(
        sub,
        "gc",
        wrap(cmd_gc),
        "apply retention to a run: keep the last N, every K-th, pinned",
        json_flag=True,
    )
    gc.add_argument("run")
    gc.add_argument("--keep-last", type=int, default=3)
    gc.add_argument("--keep-every", type=int, default=0)
    gc.add_argument("--budget-gb", type=float, default=None)
    gc.add_argument("--dry-run", action="store_true", help="show what would go and the bytes freed")
    gc.add_argument("--price-per-gb-month", type=float, default=0.023, help="for the cost report (USD)")
