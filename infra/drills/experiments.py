"""The drill scenarios: Chaos Toolkit experiments (JSON) under ``infra/drills/experiments/``.

Each carries Rewind's own settings as an extension: ``{"name": "rewind", "failure_kind": ...,
"job": {...}, "skip": "why", "needs": ["seaweedfs" | "postgres"], "incident": "optional",
"expect_failure_at": PHASE}``; a scenario with ``skip``, or needing a component this machine lacks, is
listed and recorded as skipped, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rewind.infra.drills import servers
from rewind.infra.errors import ConfigError

DIR = Path(__file__).resolve().parent / "experiments"


def load_all() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DIR.glob("*.json"))}


def load(name: str) -> dict[str, Any]:
    found = load_all()
    if name not in found:
        raise ConfigError(f"no drill scenario {name!r}; `rewind drill list` shows them: {', '.join(found)}")
    return found[name]


def rewind_ext(experiment: dict[str, Any]) -> dict[str, Any]:
    for ext in experiment.get("extensions") or []:
        if ext.get("name") == "rewind":
            return dict(ext)
    return {}


def skip_reason(ext: dict[str, Any], spec: dict[str, Any] | None = None) -> str | None:
    """Why a scenario (its rewind extension) does not run here, or against the job spec ``spec``; None if it runs."""
    if ext.get("skip"):
        return str(ext["skip"])
    for component in ext.get("needs") or []:
        why = servers.missing(str(component))
        if why:
            return f"needs {component}: {why}"
    if spec is not None and (ext.get("job") or {}).get("extra"):
        flags = " ".join(ext["job"]["extra"])
        return f"hurts the example job through its own flags {flags}; not run against a job spec"
    return None
