"""Drill actions for GPU faults on any machine: NVML's stand-in (``REWIND_NVML_STANDIN``, the one stand-in
Rewind allows) describes the GPUs the supervisor sees, and an Xid is injected by writing it there, as the
driver's event API would report it. The job, the supervisor, the catalog and the recovery are real; on a
machine with GPUs the same supervisor reads NVML's own events instead.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rewind.infra.catalog import jobs
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills.context import run_of, state_dir
from rewind.infra.errors import NotFoundError, RewindError
from rewind.infra.health.nvml import STANDIN_ENV

POLL_S = 0.2


def _standin(configuration: dict[str, Any] | None) -> Path:
    return state_dir(configuration) / "nvml-standin.json"


def _write(path: Path, data: dict[str, Any]) -> None:
    """Replaced whole (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def arm_gpus(count: int = 2, configuration: dict[str, Any] | None = None) -> str:
    """``count`` healthy GPUs, as the supervisor will see them (for the flows this drill runs)."""
    path = _standin(configuration)
    _write(path, {"gpus": [{"name": "stand-in GPU"} for _ in range(count)], "xids": []})
    os.environ[STANDIN_ENV] = str(path)
    return str(path)


def disarm_gpus(configuration: dict[str, Any] | None = None) -> None:
    os.environ.pop(STANDIN_ENV, None)


def inject_xid(
    at_step: int,
    gpu: int = 1,
    xid: int = 79,
    timeout_s: float = 180.0,
    configuration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Once the job passed ``at_step``: Xid ``xid`` on GPU ``gpu``, reported as the driver would; when."""
    run, cat, deadline = run_of(configuration), Catalog(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            launch = jobs.launches(cat, run)[-1]
        except (NotFoundError, IndexError):
            launch = None
        rows = jobs.progress(cat, launch.id) if launch is not None else []
        if rows and all((r.step or 0) >= at_step for r in rows):
            path = _standin(configuration)
            data = json.loads(path.read_text())
            _write(path, {**data, "xids": [*data.get("xids", []), {"gpu": gpu, "xid": xid}]})
            return {"gpu": gpu, "xid": xid, "at": time.time()}
        time.sleep(POLL_S)
    raise RewindError(f"{run} did not pass step {at_step} within {timeout_s:g}s")
