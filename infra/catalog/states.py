"""The states and kinds the catalog stores, as enums: every column that holds one is typed by it and
limited to its values by a CHECK constraint (``base.checked_enum``)."""

from __future__ import annotations

from enum import StrEnum


class CheckpointStatus(StrEnum):
    WRITING = "writing"
    COMMITTED = "committed"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    ABORTED = "aborted"  # the writer died before the commit
    SUPERSEDED = "superseded"  # a later save at the same step replaced it
    DELETED = "deleted"


LIVE_STATUSES = (CheckpointStatus.WRITING, CheckpointStatus.COMMITTED, CheckpointStatus.VERIFIED)


class ReplicaStatus(StrEnum):
    """What the last check of one copy found. Findings belong to copies, not to checkpoints."""

    PENDING = "pending"  # written, not yet proven byte for byte
    VERIFIED = "verified"  # every byte matched the catalog's manifest
    UNVERIFIABLE = "unverifiable"  # could not be read (I/O error, unknown key): says nothing about the bytes
    CORRUPT = "corrupt"  # bytes or manifest differ from the catalog's: never used again
    MISSING = "missing"  # the copy is gone
    DELETED = "deleted"  # removed on purpose (retention)


class RolloutState(StrEnum):
    RUNNING = "running"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    DONE = "done"


class RolloutKind(StrEnum):
    DEPLOY = "deploy"
    ROLLOUT = "rollout"
    ROLLBACK = "rollback"


class IncidentKind(StrEnum):
    """What went wrong (at most 16 characters: ``checked_enum``'s column length)."""

    CRASH = "crash"
    FAILED_TO_START = "failed_to_start"
    HANG = "hang"
    NAN = "nan"
    LOSS_SPIKE = "loss_spike"
    GPU = "gpu"
    MANUAL = "manual"
    FINISHED = "finished"  # a launch that ended well: the kind of a launch's outcome, never of an incident


class RankState(StrEnum):
    """What a rank last said of itself (``rank_progress.state``)."""

    RUNNING = "running"
    BUSY = "busy"  # in a phase that may outlast a step: restoring, starting, saving
    FINISHED = "finished"
    FAILED = "failed"
    ANOMALY = "anomaly"  # it recorded NaN/Inf or a loss spike


# A rank still at work: finishing replaces these states, an anomaly stays.
LIVE_RANK_STATES = (RankState.RUNNING, RankState.BUSY)


class DrillOutcome(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


class VersionState(StrEnum):
    EXPORTED = "exported"  # archive built, not loaded
    LOADED = "loaded"  # loaded next to the stable version, no traffic yet
    CANARY = "canary"  # taking a share of traffic under gates
    STABLE = "stable"  # takes all traffic; one per model
    PREVIOUS = "previous"  # the stable version before the last promotion, kept loaded until the bake ends
    RETIRED = "retired"  # was stable once, unloaded: a known-good rollback target
    ROLLED_BACK = "rolled_back"  # failed its gates (or was rolled back by hand) and was unloaded
    FAILED = "failed"  # could not be loaded
