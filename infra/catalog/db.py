"""Connecting to the catalog, translating database faults, applying migrations."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import CursorResult, Engine, Result, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from rewind.infra import config
from rewind.infra.errors import CatalogUnavailable, ConfigError, MissingDatabase, NotFoundError

T = TypeVar("T")

MIGRATIONS = (
    "rewind:migrations"  # a package resource: found through the installed package, not the source tree
)
_MIGRATION_LOCK = 0x52455749  # "REWI": serialises concurrent `db upgrade` on Postgres


def changed(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE changed: how a guarded statement tells who won."""
    return cast(CursorResult[Any], result).rowcount


MAX_IDS = 10_000  # ids bound in one IN list: Postgres refuses a statement with more than 65,535 parameters


def chunks(ids: Iterable[T], size: int = MAX_IDS) -> Iterator[list[T]]:
    """``ids`` in lists of at most ``size``, for statements that bind one parameter per id."""
    batch: list[T] = []
    for i in ids:
        batch.append(i)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def parse_url(raw: str) -> URL:
    """Validate a catalog URL; ``postgresql://`` means psycopg 3."""
    authority = raw.partition("://")[2].partition("/")[0]
    if authority.count("@") > 1:  # never echo any of it: part of it is a password
        raise ConfigError(
            "catalog URL has more than one '@' before the host: percent-encode '@' in the password (%40)"
        )
    try:
        url = make_url(raw)
        if url.port is not None and not 0 < url.port < 65536:  # a port that is no number fails here too
            raise ValueError("port out of range")
    except (ArgumentError, ValueError) as exc:
        shown = raw.split("@")[-1].split("?")[
            0
        ]  # neither the user part nor the query: either may hold a secret
        raise ConfigError(f"catalog URL is not a database URL: {shown!r}") from exc
    backend, _, driver = url.drivername.partition("+")
    if backend == "postgresql":
        if driver not in ("", "psycopg"):
            raise ConfigError(
                f"catalog driver {url.drivername!r} is not supported; use postgresql+psycopg://"
            )
        return url.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        return url
    raise ConfigError(f"catalog URL must be postgresql+psycopg:// or sqlite:///, got {url.drivername}://")


_SECRET_PARAMS = frozenset({"password", "sslpassword", "sslkey", "passfile", "service"})


def shown_url(url: URL) -> str:
    """The URL as errors and listings may show it: the password, and query parameters that carry or point at
    one (``?password=``, libpq's ``sslpassword``...), masked."""
    query = {k: ("***" if k.lower() in _SECRET_PARAMS else v) for k, v in url.query.items()}
    return url.set(query=query).render_as_string(hide_password=True)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()
    # pysqlite opens a transaction only at the first write, so a read-check-write is unguarded and DDL
    # autocommits statement by statement: Rewind begins every transaction itself (_sqlite_begin).
    dbapi_conn.isolation_level = None


def _sqlite_begin(conn: Any) -> None:
    """Every SQLite transaction takes the write lock when it begins: a read-check-write (the run's one
    writer, a lease, a guarded delete) is serialised across processes as ``SELECT ... FOR UPDATE`` does
    on Postgres, and creating the schema is one transaction (a kill leaves no half-made catalog)."""
    conn.exec_driver_sql("BEGIN IMMEDIATE")


@functools.cache
def _head() -> str | None:
    """The newest migration this Rewind ships: read once a process (parsing every script took ~8 ms, on
    each ``Catalog()``: a recovery's, each CLI command's, each flow task's)."""
    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS)
    return ScriptDirectory.from_config(cfg).get_current_head()


class Catalog:
    """One database holding the lineage of every run."""

    @property
    def in_memory(self) -> bool:
        """An SQLite database in this connection's memory: another thread's connection sees another one."""
        return self.url.get_backend_name() == "sqlite" and self.url.database in (None, "", ":memory:")

    def __init__(self, url: str | None = None, *, auto_upgrade: bool = True) -> None:
        self.url = parse_url(url or config.catalog_url())
        self.safe_url = shown_url(self.url)
        if self.url.get_backend_name() == "sqlite":
            if self.url.database and not self.in_memory:
                Path(self.url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            self.engine: Engine = create_engine(self.url)
            event.listen(self.engine, "connect", _sqlite_pragmas)
            event.listen(self.engine, "begin", _sqlite_begin)
        else:
            self.engine = create_engine(
                self.url, pool_pre_ping=True, pool_size=2, max_overflow=4, connect_args={"connect_timeout": 5}
            )
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        if auto_upgrade:
            self.ensure_schema()

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction; database faults come out as Rewind errors, never raw tracebacks."""
        try:
            with self._sessions.begin() as s:
                yield s
        except (OperationalError, ProgrammingError, DBAPIError) as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: DBAPIError) -> Exception:
        msg = str(exc.orig) if exc.orig is not None else str(exc)
        if "no such table" in msg or ("does not exist" in msg and "relation" in msg):
            return ConfigError(f"catalog {self.safe_url} has no schema; run `rewind db upgrade`")
        if re.search(r'database "[^"]*" does not exist', msg):  # the server answered: not "unreachable"
            return MissingDatabase(
                f"catalog {self.safe_url}: the database {self.url.database!r} does not exist on that server; "
                "`rewind db upgrade` creates it"
            )
        if isinstance(exc, OperationalError) or exc.connection_invalidated:
            first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
            return CatalogUnavailable(f"catalog {self.safe_url} is unreachable: {first}")
        return exc

    def get(self, model: type[T], key: int, what: str) -> T:
        """One row by primary key; ``NotFoundError`` naming ``what`` when there is none."""
        with self.session() as s:
            row = s.get(model, key)
        if row is None:
            raise NotFoundError(f"no {what} with id {key}")
        return row

    # -- migrations -------------------------------------------------------------

    def _alembic(self) -> Config:
        cfg = Config()
        cfg.set_main_option("script_location", MIGRATIONS)
        cfg.set_main_option(
            "sqlalchemy.url", self.url.render_as_string(hide_password=False).replace("%", "%%")
        )
        return cfg

    def head(self) -> str | None:
        return _head()

    def current(self) -> str | None:
        try:
            with self.engine.connect() as conn:
                return MigrationContext.configure(conn).get_current_revision()
        except DBAPIError as exc:
            raise self._translate(exc) from exc

    def create_database(self) -> bool:
        """Create this Postgres catalog's database through the server's ``postgres`` database, with the same
        credentials; False if it exists already. A role that may not create databases is told the command."""
        name = self.url.database
        if self.url.get_backend_name() != "postgresql" or not name:
            return False
        admin = create_engine(
            self.url.set(database="postgres"),
            isolation_level="AUTOCOMMIT",
            connect_args={"connect_timeout": 5},
        )
        try:
            with admin.connect() as conn:
                if conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first():
                    return False
                conn.execute(text(f'CREATE DATABASE "{name.replace(chr(34), chr(34) * 2)}"'))
                return True
        except ProgrammingError as exc:  # e.g. permission denied to create database
            first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
            raise ConfigError(
                f"cannot create the catalog database {name!r} ({first}): have an administrator run "
                f"`createdb -h {self.url.host or 'localhost'} -O {self.url.username or 'USER'} {name}`"
            ) from exc
        except DBAPIError as exc:
            raise self._translate(exc) from exc
        finally:
            admin.dispose()

    def migrate(self, revision: str = "head", *, down: bool = False) -> None:
        cfg = self._alembic()
        try:
            with self.engine.begin() as conn:
                if self.url.get_backend_name() == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
                cfg.attributes["connection"] = conn
                if down:
                    command.downgrade(cfg, revision)
                else:
                    command.upgrade(cfg, revision)
        except DBAPIError as exc:
            raise self._translate(exc) from exc

    def ensure_schema(self) -> None:
        """Create the schema on an empty database; refuse to run against an old one."""
        current, head = self.current(), self.head()
        if current == head:
            return
        if current is None or self.url.get_backend_name() == "sqlite":
            self.migrate("head")
            return
        raise ConfigError(
            f"catalog {self.safe_url} is at revision {current}, this Rewind needs {head}: run `rewind db upgrade`"
        )

    def close(self) -> None:
        self.engine.dispose()
