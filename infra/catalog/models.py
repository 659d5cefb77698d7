"""SQLAlchemy 2 typed models of the catalog.

Relationships are ``lazy="raise"``: every query says what it loads, so no
request quietly turns into one query per row. The serving tables live in ``serving_models`` and are
re-exported here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from rewind.infra.catalog.base import NAMING_CONVENTION, Base, aware, checked_enum, utcnow  # noqa: F401 (re-exported)
from rewind.infra.catalog.serving_models import (  # noqa: F401 (re-exported)
    ChatSession,
    ChatTurn,
    Rollout,
    RolloutStep,
    ServingVersion,
)
from rewind.infra.catalog.states import (  # noqa: F401 (re-exported)
    LIVE_RANK_STATES,
    LIVE_STATUSES,
    CheckpointStatus,
    DrillOutcome,
    IncidentKind,
    RankState,
    ReplicaStatus,
    RolloutKind,
    RolloutState,
    VersionState,
)

# A save in flight ('writing') is not live: the step's committed checkpoint stays so until it commits.
_LIVE_SQL = "status IN ('committed', 'verified')"


class Run(Base):
    __tablename__ = "run"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    config_hash: Mapped[str | None] = mapped_column(String(64))
    code_version: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The one process allowed to write checkpoints of this run (host:pid[:launch]), and when it was last seen.
    writer: Mapped[str | None] = mapped_column(Text)
    writer_seen_at: Mapped[datetime | None]

    checkpoints: Mapped[list[Checkpoint]] = relationship(back_populates="run", lazy="raise")


class Checkpoint(Base):
    __tablename__ = "checkpoint"
    __table_args__ = (
        # Only one live checkpoint per (run, step); dead ones (corrupt, aborted, deleted, superseded) stay as
        # history, and a save in flight at the step is not live until it commits (superseding the old one).
        Index(
            "uq_checkpoint_live_step",
            "run_id",
            "step",
            unique=True,
            postgresql_where=text(_LIVE_SQL),
            sqlite_where=text(_LIVE_SQL),
        ),
        Index("ix_checkpoint_run_id_step", "run_id", "step"),  # a run's checkpoints in step order
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(BigInteger)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoint.id", ondelete="SET NULL"))
    status: Mapped[CheckpointStatus] = mapped_column(
        checked_enum(CheckpointStatus, "status"), default=CheckpointStatus.WRITING
    )
    status_reason: Mapped[str | None] = mapped_column(Text)
    path: Mapped[str] = mapped_column(Text)
    layout: Mapped[dict[str, Any]] = mapped_column(default=dict)
    total_bytes: Mapped[int | None] = mapped_column(BigInteger)
    manifest_digest: Mapped[str | None] = mapped_column(String(64))
    environment: Mapped[dict[str, Any]] = mapped_column(default=dict)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    save_stall_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    committed_at: Mapped[datetime | None]
    verified_at: Mapped[datetime | None]
    updated_at: Mapped[datetime | None] = mapped_column(default=utcnow, onupdate=utcnow)

    run: Mapped[Run] = relationship(back_populates="checkpoints", lazy="raise")
    files: Mapped[list[CheckpointFile]] = relationship(
        back_populates="checkpoint", lazy="raise", cascade="all, delete-orphan"
    )


class CheckpointFile(Base):
    __tablename__ = "checkpoint_file"

    id: Mapped[int] = mapped_column(primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoint.id", ondelete="CASCADE"), index=True)
    path: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger)
    xxh3: Mapped[str] = mapped_column(String(32))
    crc32c: Mapped[str] = mapped_column(String(12))

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="files", lazy="raise")


class Replica(Base):
    __tablename__ = "replica"
    # Copies by where they lie: is a place still another copy's, which rows follow a moved directory.
    __table_args__ = (Index("ix_replica_tier_uri_key", "tier", "uri", "key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoint.id", ondelete="CASCADE"), index=True)
    tier: Mapped[str] = mapped_column(String(16))  # local | shared | offsite
    # local: the copy's directory; shared/offsite: the tier's root URI, with ``key`` below it.
    uri: Mapped[str] = mapped_column(Text)
    # Where the copy lies below ``uri`` (``<run>/step-<N>`` unless that name held another timeline).
    key: Mapped[str | None] = mapped_column(Text)
    # local: the disk that holds it (its root's ``.rewind-tier`` id) and the host that made that disk's
    # mark; NULL for shared/offsite copies (reachable from anywhere) and for local ones from before 0012.
    tier_id: Mapped[str | None] = mapped_column(String(64))
    host: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[ReplicaStatus] = mapped_column(
        checked_enum(ReplicaStatus, "status"), default=ReplicaStatus.PENDING
    )
    detail: Mapped[str | None] = mapped_column(Text)  # what the last check found
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    verified_at: Mapped[datetime | None]
    checked_at: Mapped[datetime | None]
    # memory: each file's segment digests as the copy was written (``rewind.infra.format.segments``, JSON)
    segments: Mapped[str | None] = mapped_column(Text, deferred=True)  # read only by a restore from it


class RestoreLease(Base):
    """A restore in progress holds its checkpoint: retention re-checks leases in its delete statement."""

    __tablename__ = "restore_lease"

    id: Mapped[int] = mapped_column(primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoint.id", ondelete="CASCADE"), index=True)
    holder: Mapped[str] = mapped_column(Text)
    taken_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


class Incident(Base):
    __tablename__ = "incident"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    kind: Mapped[IncidentKind] = mapped_column(
        checked_enum(IncidentKind, "kind")
    )  # never FINISHED: incidents.KINDS
    detected_at: Mapped[datetime] = mapped_column(default=utcnow)
    reason: Mapped[str | None] = mapped_column(Text)
    decision: Mapped[str | None] = mapped_column(Text)
    restored_checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoint.id", ondelete="SET NULL")
    )
    layout_before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    layout_after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    detection_s: Mapped[float | None] = mapped_column(Float)
    rebuild_s: Mapped[float | None] = mapped_column(Float)
    load_s: Mapped[float | None] = mapped_column(Float)
    replayed_steps: Mapped[int | None] = mapped_column(Integer)
    rto_s: Mapped[float | None] = mapped_column(Float)
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    resolved_at: Mapped[datetime | None]
    # What it records (``launch:<id>``): a retried record-failure finds this row instead of adding one.
    origin: Mapped[str | None] = mapped_column(String(200), unique=True)
    announced_at: Mapped[datetime | None]  # when its failure event went out (at most once per incident)
    recovered_by: Mapped[str | None] = mapped_column(String(200))  # the one recovery flow run acting on it


class JobSpecRow(Base):
    """How a run is launched (``rewind.infra.launch.spec.JobSpec`` as JSON): the supervisor starts it from this."""

    __tablename__ = "job_spec"

    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Launch(Base):
    """One start of a run's job: what it was told (world size, batch, lr scale, data to skip) and how it ended."""

    __tablename__ = "launch"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incident.id", ondelete="SET NULL"))
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    handoff: Mapped[dict[str, Any]] = mapped_column(default=dict)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    exit_code: Mapped[int | None] = mapped_column(Integer)


class RankProgress(Base):
    """What one rank of a launch last reported: progress, liveness, an anomaly; written by the rank itself."""

    __tablename__ = "rank_progress"

    launch_id: Mapped[int] = mapped_column(ForeignKey("launch.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float)
    samples: Mapped[int | None] = mapped_column(BigInteger)
    step_at: Mapped[float | None] = mapped_column(
        Float
    )  # the rank's clock (epoch s) when ``step`` was reached
    beat_at: Mapped[float] = mapped_column(Float)  # the rank's clock when it last wrote
    state: Mapped[RankState] = mapped_column(checked_enum(RankState, "state"), default=RankState.RUNNING)
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Drill(Base):
    """One recovery drill (a Chaos Toolkit experiment against a job): its outcome and where it broke.

    ``phases`` maps each recovery phase (detect, decide, rebuild, restore, relaunch, replay,
    first_step) to ``{"s": seconds or None, "status": ok|over_budget|failed|not_measured|skipped}``.
    """

    __tablename__ = "drill"

    id: Mapped[int] = mapped_column(primary_key=True)
    scenario: Mapped[str] = mapped_column(String(100), index=True)
    failure_kind: Mapped[str] = mapped_column(String(32))  # the SLO key: crash, hang, nan, corruption, ...
    run_name: Mapped[str | None] = mapped_column(String(200))
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incident.id", ondelete="SET NULL"))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    outcome: Mapped[DrillOutcome] = mapped_column(checked_enum(DrillOutcome, "outcome"))
    phases: Mapped[dict[str, Any]] = mapped_column(default=dict)
    rto_s: Mapped[float | None] = mapped_column(Float)
    rpo_steps: Mapped[int | None] = mapped_column(Integer)
    rpo_s: Mapped[float | None] = mapped_column(Float)
    loss_max_deviation: Mapped[float | None] = mapped_column(Float)
    loss_curve: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # {"steps", "loss", "reference"}
    failed_phase: Mapped[str | None] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(Text)
    seed: Mapped[int | None] = mapped_column(Integer)
    slo: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # the budget it was judged against
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the Chaos Toolkit journal's summary
