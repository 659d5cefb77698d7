"""`rewind drill list | run SCENARIO... [--all] | report [--out FILE]`: recovery drills from the command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap


def cmd_list(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.drills import experiments

    rows = []
    for name, exp in experiments.load_all().items():
        ext = experiments.rewind_ext(exp)
        rows.append({"scenario": name, "kind": ext.get("failure_kind"), "title": exp.get("title"),
                     "skipped": experiments.skip_reason(ext)})  # fmt: skip

    def text() -> str:
        return "\n".join(
            f"{r['scenario']:30} {r['kind']:12} {r['title']}"
            + (f"  [skipped: {r['skipped']}]" if r["skipped"] else "")
            for r in rows
        )

    emit(args, rows, text)
    return 0


def cmd_run(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    import os

    # The first start of the ephemeral server migrates its database: give a busy machine time.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_TASKS_DEFAULT_NO_CACHE", "true")  # as `make demo`: every task runs
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from rewind.flows.drills import run_many
    from rewind.infra.drills import experiments, slo
    from rewind.infra.drills.job import check_job_spec
    from rewind.infra.errors import ConfigError
    from rewind.infra.launch.spec import load_file

    if args.all == bool(args.scenarios):
        raise ConfigError("name scenarios or give --all (not both)")
    slo.load(args.slo)  # a bad SLO file is bad input: say so before any drill runs
    spec = load_file(args.job_spec) if args.job_spec else None
    if spec is not None:
        check_job_spec(spec)  # so is a job spec a drill cannot run
    names = list(experiments.load_all()) if args.all else args.scenarios
    catalog()  # the catalog exists and is current before anything is hurt
    results = run_many(names, slo_file=args.slo, job_spec=spec)
    if args.report:
        _write_report(catalog(), Path(args.report))

    def text() -> str:
        lines = []
        for r in results:
            rto = f"{r['rto_s']:.2f}s" if r.get("rto_s") is not None else "-"
            where = f" at {r['failed_phase']}" if r.get("failed_phase") else ""
            why = f": {r['reason']}" if r.get("reason") else ""
            note = "" if r["as_expected"] else "  (UNEXPECTED)"
            if r.get("requests") is not None:  # a serving drill: what its clients saw
                why += f" ({r['failed_requests']} of {r['requests']} requests failed"
                bad = r.get("bad_version_answers")
                why += f", {bad} answered by the bad version)" if bad is not None else ")"
            lines.append(f"{r['scenario']:30} {r['outcome']:8} RTO {rto:9} drill {r['id']}{where}{why}{note}")
        return "\n".join(lines)

    emit(args, results, text)
    return 0 if all(r["as_expected"] for r in results) else 1


def _write_report(cat: Any, out: Path) -> int:
    from sqlalchemy import select

    from rewind.infra.catalog import drills
    from rewind.infra.catalog.models import Incident, Run
    from rewind.infra.drills.report import render

    rows = drills.all_drills(cat)
    drill_incidents = {d.incident_id for d in rows if d.incident_id is not None}
    with cat.session() as s:
        real = [
            i
            for i in s.scalars(
                select(Incident).join(Run, Run.id == Incident.run_id).where(~Run.name.like("drill-%"))
            )
            if i.id not in drill_incidents
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(rows, real))
    return len(rows)


def cmd_report(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    n = _write_report(catalog(), Path(args.out))
    emit(args, {"out": args.out, "drills": n}, lambda: f"wrote {args.out} ({n} drills)")
    return 0


def cmd_goodput(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    import sys

    from rewind.infra.drills.goodput import goodput
    from rewind.infra.errors import ConfigError

    if args.steps < 10 or args.failures < 0:
        raise ConfigError("--steps must be at least 10 and --failures not negative")

    def command(run: str, out: Path, log: Path) -> list[str]:
        return [sys.executable, "-m", "rewind.examples.tiny_lm", "--run", run, "--steps", str(args.steps),
                "--checkpoint-every", str(args.every), "--seed", "0", "--out", str(out),
                "--step-time-s", str(args.step_time_s), "--loss-log", str(log)]  # fmt: skip

    got = goodput(command, steps=args.steps, failures=args.failures, seed=args.seed, warm_relaunch=args.warm)

    def text() -> str:
        w, g = got["wall_s"], got["goodput_steps_per_s"]
        return (
            f"{args.steps} steps, killed at steps {got['killed_at_steps']} (seed {got['seed']})\n"
            f"no failure    {w['no_failure']:8.2f} s  {g['no_failure']:.3f} steps/s\n"
            f"rewind        {w['rewind']:8.2f} s  {g['rewind']:.3f} steps/s\n"
            f"from scratch  {w['from_scratch']:8.2f} s  {g['from_scratch']:.3f} steps/s\n"
            f"goodput: rewind / no failure {got['rewind_vs_no_failure']:.3f}, "
            f"rewind / from scratch {got['rewind_vs_from_scratch']:.3f}"
            + (
                f"\nrewind warm   {w['rewind_warm']:8.2f} s  {g['rewind_warm']:.3f} steps/s  "
                f"(goodput / no failure {got['rewind_warm_vs_no_failure']:.3f})"
                if args.warm
                else ""
            )
        )

    emit(args, got, text)
    return 0


def register(
    sub: Any,
    add: Add,
    wrap: Wrap,
) -> None:
    dr = sub.add_parser("drill", help="recovery drills: list, run, report").add_subparsers(
        dest="drill_command", required=True, metavar="ACTION"
    )
    add(dr, "list", wrap(cmd_list), "the drill scenarios (Chaos Toolkit experiments)", json_flag=True)
    rn = add(
        dr,
        "run",
        wrap(cmd_run),
        "run scenarios against the example job (or --job-spec FILE); each is recorded in the catalog (exit 1 if any failed "
        "other than where its scenario breaks a phase on purpose)",
        json_flag=True,
    )
    rn.add_argument("scenarios", nargs="*", metavar="SCENARIO")
    rn.add_argument("--all", action="store_true", help="every scenario")
    rn.add_argument("--slo", help="SLO file (default: $REWIND_SLO_FILE or ./rewind-slo.yaml)")
    rn.add_argument("--report", metavar="FILE", help="write the HTML report afterwards")
    rn.add_argument(
        "--job-spec",
        metavar="FILE",
        help="drill this job instead of the example: a job spec (JSON or YAML: command, cwd, env, "
        "nproc_per_node, ...) whose command takes the drill's run name as {run} (also {out}, {loss_log})",
    )
    gp = add(
        dr,
        "goodput",
        wrap(cmd_goodput),
        "useful steps per second of the example under N random SIGKILLs: Rewind's resume against no "
        "failure and against restarting from scratch",
        json_flag=True,
    )
    gp.add_argument("--failures", type=int, default=3)
    gp.add_argument("--steps", type=int, default=60)
    gp.add_argument("--every", type=int, default=10, help="checkpoint every K steps")
    gp.add_argument("--step-time-s", type=float, default=0.1, help="pad each step to this long")
    gp.add_argument("--seed", type=int, default=None, help="where the kills land (default: random, printed)")
    gp.add_argument(
        "--warm", action="store_true", help="also resume from a standby interpreter (warm relaunch)"
    )
    rp = add(
        dr, "report", wrap(cmd_report), "write every drill as one self-contained HTML page", json_flag=True
    )
    rp.add_argument("--out", default="report.html")
