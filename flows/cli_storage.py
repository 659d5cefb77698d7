"""`rewind replicate`, `rewind ckpt restore`, `rewind ckpt pin`, `rewind gc`: checkpoints across tiers."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap, amount, at_least_one, count, step, whole

if TYPE_CHECKING:  # imported where used: `rewind --help` stays fast
    from rewind.infra.reclaim import Reclaim
    from rewind.infra.retention import GcPlan

MiB = 1 << 20


def _tier_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part-size-mib", type=whole(5, 5120), default=64, help="S3 multipart part size (5-5120)")
    p.add_argument("--concurrency", type=whole(1, 256), default=8, help="S3 parts in flight")
    p.add_argument(
        "--immutable-days",
        type=whole(0, 36500),
        default=None,
        help="S3 Object Lock retention in days, up to 100 years, 0 for none (bucket must allow it)",
    )


def _options(args: argparse.Namespace) -> Any:
    from rewind.infra.phases.replicate import TierOptions

    return TierOptions(
        part_size_mib=args.part_size_mib, concurrency=args.concurrency, immutable_days=args.immutable_days
    )


def cmd_replicate(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    """The replicate-offsite flow's sequence, for one run: what the target lacks, copied and proven, then
    the same retention (``--keep-last``/``--keep-every``, else REWIND_KEEP_LAST/REWIND_KEEP_EVERY)."""
    from rewind.flows import progress_view
    from rewind.flows.cli_notify import cli_notifier
    from rewind.infra.phases import replicate as phase

    target = phase.target_uri(args.to)
    policy = None if args.no_retention else phase.retention_policy(args.keep_last, args.keep_every)
    cat, notify = catalog(), cli_notifier()
    from rewind.infra.tiers import open_tier

    ids = phase.pending(
        cat, tier=open_tier(target), run=args.run
    )  # an unknown run: nothing touched at the target
    tier = phase.open_target(target, _options(args))
    rows = []
    for ck_id in ids:
        with progress_view.shown():
            made = phase.replicate_checkpoint(cat, checkpoint_id=ck_id, tier=tier, notify=notify)
        rows.append(made.as_dict())
        if not args.json:
            how = (
                "already there, verified"
                if made.already_there
                else f"{made.bytes_sent} bytes sent, {made.bytes_reused} reused from earlier copies there"
            )
            print(f"step {made.step}: replicated to {made.uri}/{made.key} ({how})", flush=True)
    if not args.json and not rows:
        print(
            f"nothing to replicate: every committed checkpoint of {args.run} has a verified copy on {target}"
        )
    removed = phase.apply_retention(cat, policy=policy, notify=notify, run=args.run) if policy else {}
    if removed.get(args.run):  # on stderr beside --json, whose rows are what was replicated
        kept = policy.keep_last if policy else 0
        out = sys.stderr if args.json else sys.stdout
        print(f"retention (keep the newest {kept}): removed steps {removed[args.run]}", file=out)
    if args.json:
        emit(args, rows, lambda: "")
    return 0


def cmd_restore(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.flows import progress_view
    from rewind.flows.cli_notify import cli_notifier
    from rewind.infra.phases.restore import restore_point

    rolling = getattr(args, "roll_back", False)
    if rolling and args.relaunch:  # the same flow the UI's restore-checkpoint form runs
        from rewind.flows.maintenance import restore_checkpoint_flow
        from rewind.flows.training import summary

        emit(
            args,
            summary(restore_checkpoint_flow(args.run, args.step, relaunch=True, return_state=True)),
            lambda: "",
        )
        return 0
    tiers = None if getattr(args, "source", None) is None else (args.source,)
    why = f"rolled back to step {args.step} by rewind rollback" if rolling else ""
    with progress_view.shown():
        done = restore_point(
            catalog(), run=args.run, notify=cli_notifier(), step=args.step, tiers=tiers, roll_back=rolling,
            reason=why,
        )  # fmt: skip
    row = {
        "step": done.step,
        "checkpoint_id": done.checkpoint_id,
        "manifest_digest": done.manifest_digest,
        "from": done.source,
        "fetched": done.fetched,
        "path": str(done.path),
        "seconds": round(done.seconds, 3),
        "skipped": [str(s) for s in done.skipped],
        "retired_checkpoint_ids": list(done.retired_checkpoint_ids),
    }

    def text() -> str:
        how = f"downloaded from {done.source} into" if done.fetched else "the local copy in"
        what = f"{how} {done.path}, every byte checked ({done.seconds:.2f}s)"
        if rolling:
            lines = [
                f"rolled {args.run} back to step {done.step}: {what}; "
                f"{len(done.retired_checkpoint_ids)} later checkpoint(s) retired; its next start resumes from here"
            ]
        else:
            lines = [
                f"staged step {done.step}: {what} (the run is not rolled back: rewind rollback does that)"
            ]
        return "\n".join(lines + [f"  skipped {s}" for s in done.skipped])

    emit(args, row, text)
    return 0


def cmd_pin(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.catalog import lineage

    lineage.set_pinned(catalog(), args.run, args.step, not args.unpin)
    print(
        f"step {args.step} of {args.run} {'unpinned' if args.unpin else 'pinned: retention will never remove it'}"
    )
    return 0


def cmd_gc(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.flows import progress_view
    from rewind.infra import reclaim as space
    from rewind.infra import retention

    cat = catalog()
    policy = retention.Policy(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        byte_budget=int(args.budget_gb * 1e9) if args.budget_gb is not None else None,
        grace_s=args.grace_days * 86400,
    )
    with progress_view.shown():
        gc = retention.plan(cat, args.run, policy)
        reclaim = space.reclaimable(cat, gc)  # counted before anything goes
        removed = [] if args.dry_run else retention.execute(cat, gc, policy)
    usage = space.usage(cat, args.run, args.price_per_gb_month)
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
    proven = ", ".join(map(str, gc.verified_first))
    lines = [f"deep-verified steps {proven} first (a kept checkpoint must prove itself)"] if proven else []
    lines.append(f"keep steps {', '.join(map(str, gc.keep)) or 'none'}")
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
    if reclaim:  # files on disk: manifests count, a file a kept checkpoint still hard-links does not
        lines.append(f"{free} per tier (files on disk, manifests included, hard-linked files excepted):")
        lines += [f"  {t:8} {r.bytes} bytes, {r.files} files" for t, r in sorted(reclaim.items())]
    else:
        lines.append(f"{free} {gc.freed_bytes} bytes")
    if not gc.reclaim:
        lines.append(
            f"copies of dead checkpoints (superseded, aborted, corrupt) go once {args.grace_days:g} days old"
        )
    price = args.price_per_gb_month
    lines += [
        f"in use on {u['tier']:8} {u['gb']:.3f} GB, ${u['usd_per_month']:.2f}/month at ${price}/GB-month"
        for u in usage
    ]
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
        "copy a run's committed checkpoints to S3 or a shared path, verified, then apply retention",
        json_flag=True,
    )
    rep.add_argument("run")
    rep.add_argument("--to", help="s3://bucket/prefix or an absolute path (default REWIND_OFFSITE_URI)")
    rep.add_argument(
        "--keep-last",
        type=at_least_one,
        default=None,
        help="afterwards keep the newest N checkpoints, deleting older ones on every tier "
        "(default REWIND_KEEP_LAST; neither set: delete nothing)",
    )
    rep.add_argument(
        "--no-retention", action="store_true", help="delete nothing, whatever REWIND_KEEP_LAST says"
    )
    rep.add_argument(
        "--keep-every",
        type=count,
        default=None,
        help="and every step divisible by K (default REWIND_KEEP_EVERY)",
    )
    _tier_options(rep)
    _register_checkpoint_commands(sub, ck, add, wrap)


def _register_checkpoint_commands(sub: Any, ck: Any, add: Add, wrap: Wrap) -> None:
    """`rewind ckpt restore`, `rewind ckpt pin`, `rewind gc`."""
    res = add(
        ck,
        "restore",
        wrap(cmd_restore),
        "stage a verified copy of a checkpoint in the local tier, from the nearest copy that proves itself "
        "(does not roll the run back: rewind rollback)",
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
    back = add(
        sub,
        "rollback",
        wrap(cmd_restore),
        "roll a run back to a verified checkpoint: later ones retired, its next start resumes from it",
        json_flag=True,
    )
    back.add_argument("run")
    back.add_argument("--step", type=step, help="default: the newest checkpoint with a copy that verifies")
    back.add_argument(
        "--relaunch", action="store_true", help="then start the job again from its spec and watch it"
    )
    back.set_defaults(roll_back=True)
    pin = add(ck, "pin", wrap(cmd_pin), "keep a checkpoint whatever the retention policy says")
    pin.add_argument("run")
    pin.add_argument("step", type=step)
    pin.add_argument("--unpin", action="store_true")
    _gc_options(
        add(
            sub,
            "gc",
            wrap(cmd_gc),
            "apply retention to a run: keep the last N verified, every K-th, pinned; reclaim dead copies",
            json_flag=True,
        )
    )


def _gc_options(gc: argparse.ArgumentParser) -> None:
    """What `rewind gc` keeps (newest N, every K-th within a budget), what it reclaims and when."""
    gc.add_argument("run")
    gc.add_argument("--keep-last", type=count, default=3, help="keep the newest N verified (default: 3)")
    gc.add_argument(
        "--keep-every", type=count, default=0, help="also keep every step divisible by K (default: off)"
    )
    gc.add_argument(
        "--budget-gb",
        type=amount,
        default=None,
        help="keep the --keep-every steps only while the kept checkpoints fit in this (newest first; "
        "default: no budget)",
    )
    gc.add_argument(
        "--grace-days",
        type=amount,
        default=7.0,
        help="reclaim copies of dead checkpoints (superseded, aborted, corrupt) and quarantined "
        "directories once this old (default: 7)",
    )
    gc.add_argument("--dry-run", action="store_true", help="show what would go and the bytes freed")
    gc.add_argument("--price-per-gb-month", type=amount, default=0.023, help="for the cost report (USD)")
