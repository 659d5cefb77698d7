"""The lineage catalog: runs, checkpoints, files, replicas and incidents."""

from infra.catalog.db import Catalog
from infra.catalog.models import Checkpoint, CheckpointFile, CheckpointStatus, Incident, Replica, Run

__all__ = ["Catalog", "Checkpoint", "CheckpointFile", "CheckpointStatus", "Incident", "Replica", "Run"]
