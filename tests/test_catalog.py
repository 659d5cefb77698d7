"""Catalog migrations on Postgres and SQLite, and guarded status transitions under a real race."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import Base, CheckpointStatus
from infra.errors import CatalogUnavailable, ConfigError

S = CheckpointStatus
TABLES = {"run", "checkpoint", "checkpoint_file", "replica", "incident"}


@pytest.fixture(params=["postgres", "sqlite"])
def empty_url(request, tmp_path: Path) -> str:
    if request.param == "postgres":
        return request.getfixturevalue("fresh_pg_url")
    return f"sqlite:///{tmp_path / 'mig.db'}"


def _tables(cat: Catalog) -> set[str]:
    return set(inspect(cat.engine).get_table_names()) - {"alembic_version"}


def test_migrations_upgrade_downgrade_and_match_models(empty_url):
    cat = Catalog(empty_url, auto_upgrade=False)
    assert cat.current() is None
    cat.migrate("head")
    assert cat.current() == cat.head()
    assert _tables(cat) >= TABLES
    with cat.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations disagree: {diff}"
    cat.migrate("base", down=True)
    assert cat.current() is None
    assert _tables(cat) == set()
    cat.migrate("head")  # and back up again, cleanly
    assert _tables(cat) >= TABLES
    cat.close()


def _committed_checkpoint(cat: Catalog, run: str, step: int) -> int:
    run_id = lineage.ensure_run(cat, run)
    ck = lineage.begin(
        cat, run_id, step, f"/nowhere/{run}/step-{step}", parent_id=None, layout={}, environment={}
    )
    assert lineage.transition(cat, ck, (S.WRITING,), S.COMMITTED)
    return ck


@pytest.mark.parametrize("backend", ["postgres", "sqlite"])
def test_racing_transitions_exactly_one_wins(backend, pg_url, tmp_path, run_name):
    url = pg_url if backend == "postgres" else f"sqlite:///{tmp_path / 'race.db'}"
    cats = [Catalog(url), Catalog(url)]  # two engines: two independent writers
    for step in range(20):
        ck = _committed_checkpoint(cats[0], run_name, step)
        barrier = threading.Barrier(2)
        results: list[bool] = [False, False]

        def racer(
            i: int,
            target: S,
            ck: int = ck,
            barrier: threading.Barrier = barrier,
            results: list[bool] = results,
        ) -> None:
            barrier.wait(timeout=10)
            results[i] = lineage.transition(cats[i], ck, (S.COMMITTED,), target, f"racer {i}")

        threads = [
            threading.Thread(target=racer, args=(0, S.VERIFIED)),
            threading.Thread(target=racer, args=(1, S.CORRUPT)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sum(results) == 1, f"step {step}: winners {results}"
        final = lineage.live_at(cats[0], lineage.get_run(cats[0], run_name).id, step)
        expected = S.VERIFIED if results[0] else S.CORRUPT
        if expected is S.VERIFIED:
            assert final is not None and final.status == S.VERIFIED
        else:
            assert final is None  # corrupt is not live


def test_one_live_checkpoint_per_step(pg_url, run_name):
    cat = Catalog(pg_url)
    _committed_checkpoint(cat, run_name, 7)
    run_id = lineage.get_run(cat, run_name).id
    with pytest.raises(Exception, match=r"uq_checkpoint_live_step|unique|UNIQUE"):
        lineage.begin(cat, run_id, 7, "/nowhere/dup", parent_id=None, layout={}, environment={})


def test_unreachable_and_bad_urls_are_clear():
    with pytest.raises(CatalogUnavailable, match="unreachable") as exc:
        Catalog("postgresql://rewind:hunter2@127.0.0.1:1/x")
    assert "hunter2" not in str(exc.value)
    with pytest.raises(ConfigError, match="not a database URL"):
        Catalog("not a url")
    with pytest.raises(ConfigError, match="must be postgresql"):
        Catalog("mysql://u@h/db")


def test_old_schema_is_refused_not_silently_used(fresh_pg_url):
    cat = Catalog(fresh_pg_url, auto_upgrade=False)
    cat.migrate("head")
    with cat.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0000_older'")
    with pytest.raises(ConfigError, match="rewind db upgrade"):
        Catalog(fresh_pg_url)
