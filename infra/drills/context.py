"""What every drill action and probe reads from the experiment's configuration: the drill's run, its
private state directory, and the run's newest restorable checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import ConfigError, NotFoundError


def run_of(configuration: dict[str, Any] | None) -> str:
    if not configuration or not configuration.get("run"):
        raise ConfigError("the experiment's configuration names no run")
    return str(configuration["run"])


def state_dir(configuration: dict[str, Any] | None) -> Path:
    d = Path(str((configuration or {}).get("state_dir") or "."))
    d.mkdir(parents=True, exist_ok=True)
    return d


def newest(run: str) -> Any:
    cat = Catalog()
    try:
        ck = lineage.restorable(cat, lineage.get_run(cat, run).id)
    except NotFoundError:
        return None
    return ck[0] if ck else None
