"""After the serving stack restarts: load each model's stable version again and settle the rest.

TorchServe forgets its registrations when it stops, while the catalog remembers
which version was stable. `rewind serving start` calls :func:`reload_stable` so a
restarted stack serves what it served before; versions that were loaded only for a
rollout go back to ``exported`` (or ``retired``), and a rollout that was in
progress is closed as failed.
"""

from __future__ import annotations

from pathlib import Path

from rewind.infra.catalog import serving as sv
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import VersionState as V
from rewind.infra.serving.backend import TorchServeBackend


def reload_stable(cat: Catalog, backend: TorchServeBackend) -> list[tuple[str, str]]:
    """Returns (model, version) for every stable version loaded again."""
    for ro in sv.running_rollouts(cat):
        sv.record_step(
            cat, ro.id, "interrupted", actor="rewind serving start", detail="serving stack restarted"
        )
        sv.finish_rollout(cat, ro.id, "failed", reason="the serving stack restarted during the rollout")
    reloaded = []
    for model in sv.models(cat):
        loaded_now = set(backend.loaded(model))
        for row in sv.versions(cat, model, (V.LOADED, V.CANARY, V.PREVIOUS)):
            if row.version not in loaded_now:
                to = V.RETIRED if row.state == V.PREVIOUS else V.EXPORTED
                sv.set_state(cat, model, row.version, to, expect=(V(row.state),))
        stable = sv.stable(cat, model)
        if stable is None or not Path(stable.artifact_uri).exists():
            continue
        backend.deploy(model, stable.version, Path(stable.artifact_uri).name)
        backend.set_traffic(model, {stable.version: 100})
        reloaded.append((model, stable.version))
    return reloaded
