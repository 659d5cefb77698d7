"""`rewind run DEPLOYMENT [-p NAME=VALUE ...]`: start a Rewind deployment on the Prefect server, as a
client of `rewind server` (its credential is used by itself: nobody sets PREFECT_API_AUTH_STRING by hand)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rewind.flows.cli_args import Add, Emit, OpenCatalog, Wrap
from rewind.flows.job_parameters import refuse_submitted_secrets
from rewind.infra.errors import ConfigError


def parameter(text: str) -> tuple[str, Any]:
    """``NAME=VALUE``; a VALUE that parses as JSON is taken as JSON (lists, numbers, true), else as text."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"a parameter is NAME=VALUE, not {text!r:.60}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def cmd_run(args: argparse.Namespace, emit: Emit, catalog: OpenCatalog) -> int:
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    api = os.environ.get("PREFECT_API_URL")
    if not api:
        raise ConfigError(
            "set PREFECT_API_URL to the server `rewind server` started (e.g. http://127.0.0.1:4200/api)"
        )
    name = args.deployment if "/" in args.deployment else f"{args.deployment}/{args.deployment}"
    params = dict(parameter(p) for p in args.param or [])
    refuse_submitted_secrets(params)  # before the server keeps them
    try:
        fr: FlowRun = run_deployment(name, parameters=params, timeout=0)  # type: ignore[assignment]
    except ObjectNotFound as exc:
        raise ConfigError(f"no deployment {name} on {api}: is `rewind serve` running against it?") from exc
    ui = f"{api.rstrip('/').removesuffix('/api')}/runs/flow-run/{fr.id}"
    row = {"deployment": name, "flow_run_id": str(fr.id), "flow_run": fr.name, "ui": ui}
    emit(args, row, lambda: f"started {name} as flow run {fr.name} ({fr.id}): {ui}")
    return 0


def register(sub: Any, add: Add, wrap: Wrap) -> None:
    run = add(
        sub,
        "run",
        wrap(cmd_run),
        "start a deployment (e.g. protect-training) on the Prefect server, with rewind server's credential",
        json_flag=True,
    )
    run.add_argument("deployment", help="protect-training, restore-checkpoint, ... (or FLOW/DEPLOYMENT)")
    run.add_argument(
        "-p",
        "--param",
        action="append",
        metavar="NAME=VALUE",
        help="a flow parameter; VALUE as JSON if it parses",
    )
