"""`prefect.yaml` for a work pool, written from the deployments table that `rewind serve` serves.

    python -m rewind.flows.prefect_yaml > prefect.yaml

The file holds nothing per site: no ``{{ $ENV }}`` placeholders (Prefect leaves an unset one as literal
text, and an automation's parameters refuse it as Jinja), no pull step (the worker imports the flows
from the installed package by module path). The worker's environment configures the flows.
"""

from __future__ import annotations

import textwrap
from typing import Any

import prefect
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
# the catalog, checkpoint roots, REWIND_OFFSITE_URI): nothing here is per site. Another pool:
# `prefect deploy --all --pool NAME`. Kubernetes: docs/orchestration.md.
"""


def document() -> dict[str, Any]:
    return {
        "name": "rewind",
        "prefect-version": prefect.__version__,
        "pull": [],
        "deployments": [_deployment(spec) for spec in DEPLOYMENTS],
    }


def _deployment(spec: DeploymentSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": spec.name,
        "entrypoint": spec.flow,
        "tags": list(spec.tags),
        "work_pool": {"name": POOL, "work_queue_name": "default"},
    }
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


def render() -> str:
    doc = document()
    deployments = doc.pop("deployments")
    parts = [HEADER, yaml.safe_dump(doc, sort_keys=False), "deployments:\n"]
    for spec, d in zip(DEPLOYMENTS, deployments, strict=True):
        body = yaml.safe_dump([d], sort_keys=False, width=100, default_flow_style=None)
        note = "".join(f"  # {line}\n" for line in textwrap.wrap(spec.note, 96))
        parts.append("\n" + note + "".join(f"  {line}\n" for line in body.splitlines()))
    return "".join(parts)


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
