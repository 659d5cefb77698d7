"""The drill scenarios: Chaos Toolkit experiments (JSON) under ``infra/drills/experiments/``.

Each carries Rewind's own settings as an extension: ``{"name": "rewind", "failure_kind": ...,
"job": {...}, "skip": "why"}``; a scenario with ``skip`` is listed and recorded as skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infra.errors import ConfigError

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
