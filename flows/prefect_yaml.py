"""`prefect.yaml` for a work pool, written from the deployments table that `rewind serve` serves.

    python -m rewind.flows.prefect_yaml > prefect.yaml
    python -m rewind.flows.prefect_yaml --pool rewind-k8s --job-variables vars.json > prefect-k8s.yaml

(``prefect deploy --all`` ignores ``--pool`` and ``--job-variable`` when a file holds several
deployments: another pool or its job variables are written into a file of their own.)

The file holds nothing per site: no ``{{ $ENV }}`` placeholders (Prefect leaves an unset one as literal
text, and an automation's parameters refuse it as Jinja), no pull step (the worker imports the flows
from the installed package by module path). The worker's environment configures the flows.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import yaml

from rewind.flows.deployments import DEPLOYMENTS, DeploymentSpec

POOL = "rewind"

HEADER = """\
# Rewind's deployments for a Prefect work pool: the same table `rewind serve` serves
# (rewind/flows/deployments.py). Written by `python -m rewind.flows.prefect_yaml > prefect.yaml`;
# tests/test_deployments.py fails when the two differ: edit the table, not this file.
#
#   prefect work-pool create rewind --type process
#   prefect deploy --all
#   REWIND_CATALOG_URL=... REWIND_CHECKPOINT_ROOT=... prefect worker start --pool rewind
#
# Flow runs import `rewind` from the worker's Python and read the worker's environment (REWIND_*,
# the catalog, checkpoint roots, REWIND_OFFSITE_URI): nothing here is per site. Another pool, or
# a pool's job variables: `python -m rewind.flows.prefect_yaml --pool NAME [--job-variables FILE]`
# writes a file of its own (`prefect deploy --all --prefect-file FILE`). Kubernetes:
# docs/orchestration.md. A redeploy pauses again what the table pauses (see there).
"""


def document(*, pool: str = POOL, job_variables: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": "rewind",
        "pull": [],
        "deployments": [_deployment(spec, pool, job_variables) for spec in DEPLOYMENTS],
    }


def _deployment(spec: DeploymentSpec, pool: str, job_variables: dict[str, Any] | None) -> dict[str, Any]:
    work_pool: dict[str, Any] = {"name": pool, "work_queue_name": "default"}
    if job_variables:
        work_pool["job_variables"] = job_variables
    out: dict[str, Any] = {
        "name": spec.name,
        "entrypoint": spec.flow,
        "tags": list(spec.tags),
        "work_pool": work_pool,
    }
    if spec.concurrency_limit is not None:
        out["concurrency_limit"] = spec.concurrency_limit
    if spec.budget():
        out["parameters"] = spec.budget()
    if spec.interval:
        out["schedules"] = [{"interval": int(spec.interval.total_seconds()), "active": not spec.paused}]
    if spec.triggers:
        out["triggers"] = [
            {
                "type": "event",
                "name": t.name,
                "description": t.description,
                "enabled": not spec.paused,
                "expect": [t.expect],
                "match": dict(t.match),
                "parameters": dict(t.parameters),
            }
            for t in spec.triggers
        ]
    return out


def render(*, pool: str = POOL, job_variables: dict[str, Any] | None = None) -> str:
    doc = document(pool=pool, job_variables=job_variables)
    deployments = doc.pop("deployments")
    parts = [HEADER, yaml.safe_dump(doc, sort_keys=False), "deployments:\n"]
    for spec, d in zip(DEPLOYMENTS, deployments, strict=True):
        body = yaml.safe_dump([d], sort_keys=False, width=100, default_flow_style=None)
        note = "".join(f"  # {line}\n" for line in textwrap.wrap(spec.note, 96))
        parts.append("\n" + note + "".join(f"  {line}\n" for line in body.splitlines()))
    return "".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m rewind.flows.prefect_yaml", description=__doc__.splitlines()[0]
    )
    p.add_argument("--pool", default=POOL, help=f"the work pool every deployment goes to (default {POOL})")
    p.add_argument(
        "--job-variables", type=Path, metavar="FILE", help="a JSON object: the pool's job variables"
    )
    args = p.parse_args(argv)
    variables = json.loads(args.job_variables.read_text()) if args.job_variables else None
    if variables is not None and not isinstance(variables, dict):
        p.error(f"{args.job_variables} must hold a JSON object")
    print(render(pool=args.pool, job_variables=variables), end="")


if __name__ == "__main__":
    main()
