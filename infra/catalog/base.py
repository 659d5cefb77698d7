"""What every table of the catalog is made with: the declarative base, its naming convention, UTC
timestamps, and string columns limited to an enum's values."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, DateTime, Enum, MetaData
from sqlalchemy.orm import DeclarativeBase

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def aware(ts: datetime) -> datetime:
    """A timestamp from the catalog in UTC: SQLite hands them back without a zone; Rewind writes UTC only."""
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


def checked_enum(cls: type[StrEnum], name: str) -> Enum:
    """A string column limited to ``cls``'s values by a named CHECK constraint (no native enum type)."""
    return Enum(
        cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )
