"""`rewind replicate`, `rewind ckpt restore`, `rewind ckpt pin`, `rewind gc`: checkpoints across tiers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from flows.cli_args import Add, Emit, OpenCatalog, Wrap, amount, count, step
from infra.errors import RewindError

if TYPE_CHECKING:  # imported where used: `rewind --help` stays fast
    from infra.retention import GcPlan, Reclaim

MiB = 1 << 20


def _tier_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part-size-mib", type=count, default=64, help="S3 multipart part size")
    p.add_argument("--concurrency", type=count, default=8, help="S3 parts in flight")
    p.add_argument(
        "--immutable-days", type=count, default=None, help="S3 Object Lock retention (bucket must allow it)"
    )


def _open(uri: str, args: argparse.Namespace) -> Any:
    from infra.tiers import open_tier

    if uri.startswith("s3://"):
        return open_tier(
            uri,
            part_size=args.part_size_mib * MiB,
            concurrency=args.concurrency,
            immutable_days=args.immutable_days,
        )
    return open_tier(uri)


def cmd_replicate(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    import os

    from flows import progress_view
    from infra.catalog import copies, lineage
    from infra.replication import replicate

    target = args.to or os.environ.get("REWIND_OFFSITE_URI") or os.environ.get("REWIND_SHARED_URI")
    if not target:
        raise RewindError("no target: pass --to s3://bucket/prefix (or a path), or set REWIND_OFFSITE_URI")
    cat = catalog()
    lineage.get_run(cat, args.run)  # an unknown run: nothing to do, and nothing created at the target
    tier = _open(target, args)
    tier.check()
    rows = []
    for ck in copies.without_copy(cat, tier.name, tier.uri, args.run):
        with progress_view.shown():
            done = replicate(cat, ck, tier)
        rows.append(
            {
                "step": ck.step,
                "bytes_sent": done.bytes_sent,
                "bytes_reused": done.bytes_reused,
                "tier": tier.name,
                "uri": tier.uri,
                "key": done.key,
            }
        )
        if not args.json:
            how = (
                "already there, verified"
                if done.already_there
                else f"{done.bytes_sent} bytes sent, {done.bytes_reused} reused from earlier copies there"
            )
            print(f"step {ck.step}: replicated to {tier.uri}/{done.key} ({how})", flush=True)
    if args.json:
        emit(args, rows, lambda: "")
    elif not rows:
        print(
            f"nothing to replicate: every committed checkpoint of {args.run} has a verified copy on {target}"
        )
    return 0


def cmd_restore(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from flows import progress_view
    from infra.restore.foreign import verified_directory

    tiers = None if args.source is None else (args.source,)
    with progress_view.shown():
        done = verified_directory(catalog(), args.run, step=args.step, tiers=tiers)
    row = {
        "step": done.step,
        "from": done.source,
        "fetched": done.fetched,
        "path": str(done.directory),
        "seconds": round(done.seconds, 3),
        "skipped": [str(s) for s in done.skipped],
    }

    def text() -> str:
        how = f"downloaded from {done.source}" if done.fetched else "the local copy, verified in place"
        lines = [
            f"restored step {done.step}: {how}, every byte checked ({done.seconds:.2f}s) into {done.directory}"
        ]
        return "\n".join(lines + [f"  skipped {s}" for s in done.skipped])

    emit(args, row, text)
    return 0


def cmd_pin(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from infra.catalog import lineage

    lineage.set_pinned(catalog(), args.run, args.step, not args.unpin)
    print(
        f"step {args.step} of {args.run} {'unpinned' if args.unpin else 'pinned: retention will never remove it'}"
    )
    return 0


def cmd_gc(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from flows import progress_view
    from infra import retention

    cat = catalog()
    policy = retention.Policy(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        byte_budget=int(args.budget_gb * 1e9) if args.budget_gb is not None else None,
        grace_s=args.grace_days * 86400,
    )
    with progress_view.shown():
        gc = retention.plan(cat, args.run, policy)
        reclaim = retention.reclaimable(cat, gc)  # counted before anything goes
        removed = [] if args.dry_run else retention.execute(cat, gc, policy)
    usage = retention.usage(cat, args.run, args.price_per_gb_month)
    out = {
        "run": args.run,
        "dry_run": args.dry_run,
        "keep": gc.keep,
        "verified_first": gc.verified_first,
        "remove": [
            {"step": r.step, "bytes": r.bytes, "copies": [c.tier for c in r.copies]} for r in gc.remove
        ],
        "reclaim": [
            {"step": r.step, "bytes": r.bytes, "copies": [c.tier for c in r.copies]} for r in gc.reclaim
        ],
        "quarantine": [str(p) for p in gc.quarantine],
        "freed_bytes": gc.freed_bytes,
        "reclaimable": {t: {"bytes": r.bytes, "files": r.files} for t, r in sorted(reclaim.items())},
        "removed": removed,
        "usage": usage,
    }

    emit(args, out, lambda: _gc_text(args, gc, removed, reclaim, usage))
    return 0


def _gc_text(
    args: argparse.Namespace,
    gc: GcPlan,
    removed: list[int],
    reclaim: dict[str, Reclaim],
    usage: list[dict[str, object]],
) -> str:
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"verified steps {gc.verified_first} first"] if gc.verified_first else []
    lines.append(f"keep steps {gc.keep}")
    lines += [
        f"{verb} step {r.step} ({r.bytes} bytes x {len(r.copies)} copies: {', '.join(c.tier for c in r.copies)})"
        for r in gc.remove
        if args.dry_run or r.step in removed
    ]
    lines += [
        f"kept step {r.step}: needed again since the plan"
        for r in gc.remove
        if not args.dry_run and r.step not in removed
    ]
    lines += [
        f"{verb} dead copies of step {r.step} ({', '.join(c.tier for c in r.copies)})" for r in gc.reclaim
    ]
    lines += [f"{verb} {p}" for p in gc.quarantine]
    free = "would free" if args.dry_run else "freed"
    if reclaim:  # a file a kept checkpoint still hard-links frees nothing: less than the copies' sizes
        lines.append(f"{free} per tier, of {gc.freed_bytes} bytes of copies listed:")
        lines += [f"  {t:8} {r.bytes} bytes, {r.files} files" for t, r in sorted(reclaim.items())]
    else:
        lines.append(f"{free} {gc.freed_bytes} bytes")
    lines += [f"{u['tier']:8} {u['gb']:10.3f} GB  ${u['usd_per_month']:.2f}/month" for u in usage]
    return "\n".join(lines)


def register(
    sub: Any,
    ck: Any,
    add: Add,
    wrap: Wrap,
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
        "put a verified copy of a checkpoint in the local tier, from the nearest copy that proves itself",
        json_flag=True,
    )
    res.add_argument("run")
    res.add_argument("--step", type=step, help="default: the newest checkpoint with a copy that verifies")
    res.add_argument(
        "--from",
        dest="source",
        choices=["shared", "offsite"],
        help="only copies on this tier (default: nearest first)",
    )
    pin = add(ck, "pin", wrap(cmd_pin), "keep a checkpoint whatever the retention policy says")
    pin.add_argument("run")
    pin.add_argument("step", type=step)
    pin.add_argument("--unpin", action="store_true")
    gc = add(
        sub,
        "gc",
        wrap(cmd_gc),
        "apply retention to a run: keep the last N verified, every K-th, pinned; reclaim dead copies",
        json_flag=True,
    )
    gc.add_argument("run")
    gc.add_argument("--keep-last", type=count, default=3)
    gc.add_argument("--keep-every", type=count, default=0)
    gc.add_argument("--budget-gb", type=amount, default=None)
    gc.add_argument(
        "--grace-days", type=amount, default=7.0, help="reclaim dead copies and quarantine after this"
    )
    gc.add_argument("--dry-run", action="store_true", help="show what would go and the bytes freed")
    gc.add_argument("--price-per-gb-month", type=amount, default=0.023, help="for the cost report (USD)")
