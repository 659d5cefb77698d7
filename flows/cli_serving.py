"""`rewind serving ...`: start the stack, deploy, roll out, roll back, and show where versions came from."""

from __future__ import annotations

import argparse
from typing import Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap, amount, count, step
from rewind.flows.cli_output import table


def cmd_start(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.serving import stack
    from rewind.infra.serving.backend import TorchServeBackend
    from rewind.infra.serving.restart import reload_stable

    st = stack.start(inference_port=args.port, instances=args.instances)
    b = TorchServeBackend(st)
    try:
        reloaded = reload_stable(catalog(), b)
    finally:
        b.close()
    stable = [f"{m} {v}" for m, v in reloaded]
    out = {
        **st.endpoints.as_dict(),
        "key_file": str(st.endpoints.key_file),
        "pid": st.pid,
        "instances": [ep.inference for ep in st.all],
        "reloaded": stable,
    }
    emit(args, out, lambda: f"TorchServe up ({len(st.all)} instance(s)): inference {out['inference']}, management {out['management']}\n"
                            f"keys in {out['key_file']} (token auth on); stable versions loaded again: "
                            f"{', '.join(stable) or 'none'}")  # fmt: skip
    return 0


def cmd_stop(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.serving import stack

    stack.stop()
    print("serving stack stopped")
    return 0


def _rollout_text(out: dict[str, Any]) -> str:
    line = f"{out.get('state')}: version {out.get('version')}"
    if out.get("reason"):
        line += f" ({out['reason']})"
    if out.get("switch_s") is not None:
        line += f"; traffic switched {out['switch_s'] * 1000:.1f} ms after the decision"
    return line


def cmd_deploy(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.flows.serving import deploy_model
    from rewind.infra.serving.export import verified_checkpoint

    verified_checkpoint(catalog(), args.run, args.step)  # refused in one line before any flow starts

    out = deploy_model(args.model, args.run, args.step, version=args.version, handler=args.handler,
                       extra_files=args.extra_file, triggered_by=args.by)  # fmt: skip
    emit(args, out, lambda: f"{args.model} {out['version']} loaded from {args.run}@{args.step}; "
                            f"stable: {out['stable']}")  # fmt: skip
    return 0


def cmd_rollout(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.flows.serving import rollout_model
    from rewind.infra.errors import ConfigError
    from rewind.infra.serving.export import verified_checkpoint

    verified_checkpoint(catalog(), args.run, args.step)  # refused in one line before any flow starts
    try:
        steps = [int(x) for x in args.steps.split(",")]
    except ValueError:
        raise ConfigError(f"--steps takes percentages like 10,50,100, got {args.steps!r}") from None
    out = rollout_model(
        args.model, args.run, args.step, traffic_steps=steps, bake_s=args.bake, checks_per_step=args.checks,
        max_error_rate=args.max_error_rate, max_p95_latency_ms=args.max_p95_ms, min_quality=args.min_quality,
        probe_set=args.probe_set, failure_limit=args.failure_limit, version=args.version, handler=args.handler,
        extra_files=args.extra_file, triggered_by=args.by, warm_s=args.warm,
    )  # fmt: skip
    emit(args, out, lambda: _rollout_text(out))
    return 0 if out["state"] == "promoted" else 1


def cmd_rollback(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.flows.serving import rollback_model
    from rewind.infra.catalog import serving

    serving.versions(catalog(), args.model)  # an unknown model: one line, before any flow starts
    if args.to is not None:
        serving.get_version(catalog(), args.model, args.to)

    out = rollback_model(args.model, to_version=args.to, reason=args.reason, triggered_by=args.by)
    emit(args, out, lambda: _rollout_text(out))
    return 0


def cmd_status(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.catalog import serving as sv
    from rewind.infra.serving import stack
    from rewind.infra.serving.backend import TorchServeBackend

    rows = sv.versions(catalog(), args.model, sv.LOADED)
    b = TorchServeBackend(stack.load())
    try:
        live = b.traffic(args.model)
        endpoint = b.endpoint(args.model) if live else None
        proxy = b.stack.proxy(args.model)
        out = {
            "model": args.model,
            "endpoint": f"{endpoint}/predictions/{args.model}" if endpoint else None,
            # the proxy's view of each TorchServe instance: UP, DOWN, MAINT (being restarted)
            "instances": {str(i): s for i, s in proxy.instances().items()} if proxy.running() else {},
            "versions": [
                {
                    "version": r.version,
                    "state": r.state,
                    "weight": live.get(r.version, r.weight),
                    "healthy": b.health(args.model, r.version).ok,
                    "run": r.run,
                    "step": r.step,
                }
                for r in rows
            ],
        }
    finally:
        b.close()
    emit(args, out, lambda: f"{args.model} at {out['endpoint']}; instances: "
                            + (", ".join(f"{i} {s}" for i, s in out["instances"].items()) or "none") + "\n"
                            + table(out["versions"], ["version", "state", "weight", "healthy", "run", "step"]))  # fmt: skip
    return 0


def cmd_history(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from rewind.infra.catalog import serving as sv

    cat = catalog()
    versions = [
        {
            "version": r.version,
            "state": r.state,
            "run": r.run,
            "step": r.step,
            "manifest_digest": r.manifest_digest,
            "artifact_digest": r.artifact_digest,
            "created_at": r.created_at.isoformat(timespec="seconds"),
            "promoted_at": r.promoted_at.isoformat(timespec="seconds") if r.promoted_at else None,
        }
        for r in sv.versions(cat, args.model)
    ]
    changes = [
        {
            "id": r.id,
            "kind": r.kind,
            "from": r.from_version,
            "to": r.to_version,
            "state": r.state,
            "triggered_by": r.triggered_by,
            "reason": r.reason,
            "switch_ms": round(r.switch_s * 1000, 1) if r.switch_s is not None else None,
            "started_at": r.started_at.isoformat(timespec="seconds"),
        }
        for r in sv.rollouts(cat, args.model)
    ]
    out = {"model": args.model, "versions": versions, "rollouts": changes}
    emit(args, out, lambda: table(versions, ["version", "state", "run", "step", "manifest_digest", "promoted_at"])
         + "\n\n" + table(changes, ["id", "kind", "from", "to", "state", "switch_ms", "triggered_by", "reason"]))  # fmt: skip
    return 0


def _artifact_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    p.add_argument("--run", required=True, help="the training run the checkpoint belongs to")
    p.add_argument("--step", type=step, required=True, help="a verified checkpoint of that run")
    p.add_argument("--version", help="version name (default: the next number)")
    p.add_argument(
        "--handler",
        help="TorchServe handler file (required on a model's first deploy; then the stable version's)",
    )
    p.add_argument("--extra-file", action="append", help="a file the handler imports (repeatable)")
    p.add_argument("--by", help="who triggered this, for the record (default: your user name)")


def _rollout_options(ro: argparse.ArgumentParser) -> None:
    """What a rollout deploys (the artifact), its traffic steps and the gates each step must pass."""
    _artifact_options(ro)
    ro.add_argument("--steps", default="10,50,100", help="traffic percentages (default 10,50,100)")
    ro.add_argument("--bake", type=amount, default=60.0, help="seconds per step")
    ro.add_argument("--checks", type=count, default=1, help="gate checks per step")
    ro.add_argument(
        "--warm",
        type=amount,
        default=120.0,
        help="seconds the old version stays loaded after promotion while the gates keep watching (0: none)",
    )
    ro.add_argument("--max-error-rate", type=amount, default=0.05)
    ro.add_argument("--max-p95-ms", type=amount, default=1000.0)
    ro.add_argument("--min-quality", type=amount, help="share of probes answered right (needs --probe-set)")
    ro.add_argument("--probe-set", help="JSON lines {input, expected}")
    ro.add_argument(
        "--failure-limit", type=count, default=0, help="failed checks tolerated before rolling back"
    )


def register(
    sub: Any,
    add: Add,
    wrap: Wrap,
) -> None:
    sv = sub.add_parser("serving", help="model serving: deploy, canary, roll back").add_subparsers(
        dest="serving_command", required=True, metavar="ACTION"
    )
    start = add(sv, "start", wrap(cmd_start), "start TorchServe on 127.0.0.1 (token auth on)", json_flag=True)
    start.add_argument("--port", type=count, help="inference port of instance 0 (default: a free one)")
    start.add_argument(
        "--instances",
        type=count,
        default=1,
        help="TorchServe instances behind each model's proxy; each loads every version (default 1)",
    )
    add(sv, "stop", wrap(cmd_stop), "stop the proxies and the TorchServe that `start` started")
    dep = add(sv, "deploy", wrap(cmd_deploy), "export a verified checkpoint and load it", json_flag=True)
    _artifact_options(dep)
    ro = add(
        sv,
        "rollout",
        wrap(cmd_rollout),
        "canary a checkpoint under gates; promote or roll back",
        json_flag=True,
    )
    _rollout_options(ro)
    rb = add(
        sv, "rollback", wrap(cmd_rollback), "all traffic back to a known-good version, now", json_flag=True
    )
    rb.add_argument("model")
    rb.add_argument("--to", help="version (default: the previous stable one)")
    rb.add_argument("--reason", default="manual rollback")
    rb.add_argument("--by", help="who triggered this, for the record")
    for long_running in (start, dep, ro, rb):  # SIGTERM: stop at the next wait, clean up, exit (flows/cli.py)
        long_running.set_defaults(cooperative=True)
    st = add(sv, "status", wrap(cmd_status), "loaded versions, live weights, health", json_flag=True)
    st.add_argument("model")
    hi = add(
        sv,
        "history",
        wrap(cmd_history),
        "every version with its run, step and manifest digest",
        json_flag=True,
    )
    hi.add_argument("model")
