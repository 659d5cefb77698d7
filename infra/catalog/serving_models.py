"""The catalog's serving tables: model versions, rollouts and their timelines, chat sessions and turns.

Re-exported by ``rewind.infra.catalog.models``, which every user of the catalog imports: the tables are
registered with the one ``Base`` whichever module is imported first.
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
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from rewind.infra.catalog.base import Base, checked_enum, utcnow
from rewind.infra.catalog.states import RolloutKind, RolloutState, VersionState

_STABLE_SQL = "state = 'stable'"


class ServingVersion(Base):
    """One model version in serving, with the training checkpoint it came from."""

    __tablename__ = "serving_version"
    __table_args__ = (
        UniqueConstraint("model", "version"),
        Index(
            "uq_serving_version_stable",
            "model",
            unique=True,
            postgresql_where=text(_STABLE_SQL),
            sqlite_where=text(_STABLE_SQL),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(63))
    version: Mapped[str] = mapped_column(String(63))
    checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoint.id", ondelete="SET NULL"), index=True
    )
    # Copied from the checkpoint so the lineage survives the checkpoint's deletion.
    run: Mapped[str] = mapped_column(String(200))
    step: Mapped[int] = mapped_column(BigInteger)
    manifest_digest: Mapped[str] = mapped_column(String(64))
    artifact_uri: Mapped[str] = mapped_column(Text)
    artifact_digest: Mapped[str] = mapped_column(String(64))
    artifact_bytes: Mapped[int] = mapped_column(BigInteger)
    # What the archive was packed with (absolute paths); the model's next version reuses them.
    handler: Mapped[str | None] = mapped_column(Text)
    extra_files: Mapped[list[str] | None] = mapped_column(JSON)
    state: Mapped[VersionState] = mapped_column(
        checked_enum(VersionState, "state"), default=VersionState.EXPORTED
    )
    weight: Mapped[int] = mapped_column(Integer, default=0)
    was_stable: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    loaded_at: Mapped[datetime | None]
    promoted_at: Mapped[datetime | None]
    unloaded_at: Mapped[datetime | None]


class Rollout(Base):
    """One change of what serves a model: a deploy, a gated rollout or a rollback."""

    __tablename__ = "rollout"

    id: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(63), index=True)
    kind: Mapped[RolloutKind] = mapped_column(checked_enum(RolloutKind, "kind"))
    from_version: Mapped[str | None] = mapped_column(String(63))
    to_version: Mapped[str] = mapped_column(String(63))
    state: Mapped[RolloutState] = mapped_column(
        checked_enum(RolloutState, "state"), default=RolloutState.RUNNING
    )
    triggered_by: Mapped[str] = mapped_column(Text)
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    reason: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    decided_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    switch_s: Mapped[float | None] = mapped_column(Float)
    origin: Mapped[str | None] = mapped_column(String(200), unique=True)  # ``flow-run:<id>:<kind>``


class RolloutStep(Base):
    """One entry of a rollout's timeline: weights set, a gate evaluated, a version loaded or unloaded."""

    __tablename__ = "rollout_step"

    id: Mapped[int] = mapped_column(primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollout.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    action: Mapped[str] = mapped_column(String(32))
    actor: Mapped[str] = mapped_column(String(200))
    weights: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    gates: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    passed: Mapped[bool | None] = mapped_column(Boolean)
    detail: Mapped[str | None] = mapped_column(Text)


class ChatSession(Base):
    """A conversation served by a generative model: its history lives here, not in the serving process.

    ``tokens`` is every token so far (prompts and replies, in order), so any instance can take the
    conversation over; ``blocks`` names its KV-cache blocks (``[prefix hash, content digest, end]`` per
    full block) so that instance can load them from a tier and check every byte first.
    """

    __tablename__ = "chat_session"

    id: Mapped[int] = mapped_column(primary_key=True)
    session_key: Mapped[str] = mapped_column(String(200), unique=True)  # the client's session_id
    model: Mapped[str] = mapped_column(String(100))
    tokens: Mapped[list[int]] = mapped_column(JSON, default=list)
    blocks: Mapped[list[Any]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_turn_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)


class ChatTurn(Base):
    """One turn of a conversation, written before its reply is returned."""

    __tablename__ = "chat_turn"
    __table_args__ = (UniqueConstraint("session_id", "n"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("chat_session.id", ondelete="CASCADE"), index=True)
    n: Mapped[int] = mapped_column(Integer)  # 1, 2, ... within the session
    prompt: Mapped[list[int]] = mapped_column(JSON)
    reply: Mapped[list[int]] = mapped_column(JSON)
    instance: Mapped[str | None] = mapped_column(String(200))  # who answered
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
