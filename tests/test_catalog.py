"""Catalog migrations on Postgres and SQLite, and guarded status transitions under a real race."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from rewind.infra.catalog import commits, drills, incidents, jobs, lineage, serving
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import LIVE_STATUSES, Base, CheckpointStatus, IncidentKind
from rewind.infra.errors import CatalogUnavailable, ConfigError

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


def test_migration_0003_maps_old_statuses_and_enforces_enums(empty_url):
    cat = Catalog(empty_url, auto_upgrade=False)
    cat.migrate("0002")
    at = {"at": "2026-11-29 12:00:00+00:00"}
    with cat.engine.begin() as conn:
        conn.execute(text("INSERT INTO run (id, name, created_at) VALUES (1, 'old', :at)"), at)
        conn.execute(
            text(
                "INSERT INTO checkpoint (id, run_id, step, status, path, layout, environment, metrics,"
                " pinned, created_at) VALUES (1, 1, 10, 'verified', '/old/step-10', '{}', '{}', '{}',"
                " false, :at)"
            ),
            at,
        )
        for replica_id, status in ((1, "restoring"), (2, "verified")):
            conn.execute(
                text(
                    "INSERT INTO replica (id, checkpoint_id, tier, uri, status, created_at)"
                    " VALUES (:id, 1, 'local', '/old/step-10', :status, :at)"
                ),
                {"id": replica_id, "status": status, **at},
            )
        conn.execute(
            text(
                "INSERT INTO rollout (id, model, kind, to_version, state, triggered_by, params, started_at)"
                " VALUES (1, 'm', 'deploy', 'v1', 'running', 'test', '{}', :at)"
            ),
            at,
        )

    cat.migrate("head")
    with cat.engine.connect() as conn:
        # Both replicas survive (rebuilding a parent table on SQLite must not cascade into them).
        assert dict(conn.execute(text("SELECT id, status FROM replica")).all()) == {
            1: "pending",
            2: "verified",
        }
        assert conn.execute(text("SELECT state FROM rollout")).scalar_one() == "running"
    bogus = text("UPDATE replica SET status = 'bogus' WHERE id = 2")
    with pytest.raises(IntegrityError, match="ck_replica_status"), cat.engine.begin() as conn:
        conn.execute(bogus)

    cat.migrate("0002", down=True)
    with cat.engine.begin() as conn:
        conn.execute(bogus)  # the constraint is gone with the revision
        assert conn.execute(text("SELECT status FROM replica WHERE id = 2")).scalar_one() == "bogus"
    cat.close()


def test_migration_0011_enforces_kinds_states_outcomes_and_keeps_rows(empty_url):
    cat = Catalog(empty_url, auto_upgrade=False)
    cat.migrate("0010")
    lineage.ensure_run(cat, "old")
    incident = incidents.open_incident(cat, "old", "hang", "no progress")
    with pytest.raises(ConfigError, match="incident kind 'finished' is not one of"):
        incidents.open_incident(cat, "old", IncidentKind.FINISHED, "a launch that ended well")
    launch = jobs.begin_launch(cat, "old", {}, {}, incident_id=incident)
    jobs.report(cat, launch, 0, node="n0", pid=1, beat_at=1.0, state="anomaly")
    drill = drills.record(cat, scenario="s", failure_kind="hang", outcome="passed", incident_id=incident)
    rollout = serving.begin_rollout(cat, "m", "deploy", "v1", from_version=None, triggered_by="test")
    serving.record_step(cat, rollout, "load", actor="test")

    cat.migrate("head")
    with cat.engine.connect() as conn:  # rewriting parent tables on SQLite must not fire their foreign keys
        assert conn.execute(text("SELECT incident_id FROM launch")).scalar_one() == incident
        assert conn.execute(text("SELECT incident_id FROM drill")).scalar_one() == incident
        assert conn.execute(text("SELECT count(*) FROM rollout_step")).scalar_one() == 1
        assert conn.execute(text("SELECT state FROM rank_progress")).scalar_one() == "anomaly"
    bogus = {
        "ck_incident_kind": f"UPDATE incident SET kind = 'anomaly' WHERE id = {incident}",
        "ck_rank_progress_state": "UPDATE rank_progress SET state = 'hung'",
        "ck_drill_outcome": f"UPDATE drill SET outcome = 'ok' WHERE id = {drill}",
        "ck_rollout_kind": f"UPDATE rollout SET kind = 'canary' WHERE id = {rollout}",
    }
    for name, sql in bogus.items():
        with pytest.raises(IntegrityError, match=name), cat.engine.begin() as conn:
            conn.execute(text(sql))

    cat.migrate("0010", down=True)
    with cat.engine.begin() as conn:  # the constraints are gone with the revision
        for sql in bogus.values():
            conn.execute(text(sql))
    with pytest.raises(RuntimeError, match=r"incident.kind holds \['anomaly'\]"):
        cat.migrate("head")  # refused, on SQLite too, instead of leaving rows no code understands
    assert cat.current() == "0010"
    cat.close()


def _committed_checkpoint(cat: Catalog, run: str, step: int) -> int:
    run_id = lineage.ensure_run(cat, run)
    ck = commits.begin(
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
        live = lineage.checkpoints_at(cats[0], lineage.get_run(cats[0], run_name).id, step, LIVE_STATUSES)
        final = live[0] if live else None
        expected = S.VERIFIED if results[0] else S.CORRUPT
        if expected is S.VERIFIED:
            assert final is not None and final.status == S.VERIFIED
        else:
            assert final is None  # corrupt is not live


def test_one_live_checkpoint_per_step(pg_url, run_name):
    cat = Catalog(pg_url)
    _committed_checkpoint(cat, run_name, 7)
    run_id = lineage.get_run(cat, run_name).id
    # a save of the step again is in flight beside it (the committed one stays live until that commits)...
    again = commits.begin(cat, run_id, 7, "/nowhere/dup", parent_id=None, layout={}, environment={})
    with pytest.raises(Exception, match=r"uq_checkpoint_live_step|unique|UNIQUE"):
        lineage.transition(cat, again, (S.WRITING,), S.COMMITTED)  # ...but never two live at one step


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
