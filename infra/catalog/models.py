"""SQLAlchemy 2 typed models of the catalog.

Relationships are ``lazy="raise"``: every query says what it loads, so no
request quietly turns into one query per row.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class CheckpointStatus(StrEnum):
    WRITING = "writing"
    COMMITTED = "committed"
    VERIFIED = "verified"
    CORRUPT = "corrupt"
    ABORTED = "aborted"  # the writer died before the commit
    SUPERSEDED = "superseded"  # a later save at the same step replaced it
    DELETED = "deleted"


LIVE_STATUSES = (CheckpointStatus.WRITING, CheckpointStatus.COMMITTED, CheckpointStatus.VERIFIED)
_LIVE_SQL = "status IN ('writing', 'committed', 'verified')"


class Run(Base):
    __tablename__ = "run"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    config_hash: Mapped[str | None] = mapped_column(String(64))
    code_version: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    checkpoints: Mapped[list[Checkpoint]] = relationship(back_populates="run", lazy="raise")


class Checkpoint(Base):
    __tablename__ = "checkpoint"
    __table_args__ = (
        # Only one live checkpoint per (run, step); dead ones (corrupt, aborted, deleted) stay as history.
        Index(
            "uq_checkpoint_live_step",
            "run_id",
            "step",
            unique=True,
            postgresql_where=text(_LIVE_SQL),
            sqlite_where=text(_LIVE_SQL),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(BigInteger)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoint.id", ondelete="SET NULL"))
    status: Mapped[str] = mapped_column(String(16), default=CheckpointStatus.WRITING.value)
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

    id: Mapped[int] = mapped_column(primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoint.id", ondelete="CASCADE"), index=True)
    tier: Mapped[str] = mapped_column(String(16))  # local | shared | offsite
    uri: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(
        String(16), default="pending"
    )  # pending | verified | corrupt | deleted
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    verified_at: Mapped[datetime | None]


class Incident(Base):
    __tablename__ = "incident"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # crash | hang | nan | loss_spike | gpu | manual
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
