"""Alembic environment: runs on a connection handed over by ``Catalog.migrate``,
or, from the ``alembic`` command line, on ``REWIND_CATALOG_URL``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from rewind.infra import config as rewind_config
from rewind.infra.catalog.db import parse_url
from rewind.infra.catalog.models import Base

target_metadata = Base.metadata


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.config.get_main_option("sqlalchemy.url") or rewind_config.catalog_url()
    engine = create_engine(parse_url(url))
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
