"""The lineage catalog: runs, checkpoints, files, replicas and incidents."""

from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, CheckpointFile, CheckpointStatus, Incident, Replica, Run

__all__ = ["Catalog", "Checkpoint", "CheckpointFile", "CheckpointStatus", "Incident", "Replica", "Run"]
