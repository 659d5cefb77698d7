"""Catalog scale, scaled down: listing, restore plans, retention plans and status read a run in a fixed
number of SQL statements however many checkpoints it has, and still give the answers the row-by-row
reading gives. The same synthetic catalog as ``bench/catalog_scale.py``, ~3,000 checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select, text

from bench.catalog_scale import Statements, database
from bench.synthetic_catalog import Shape, build, fork_run, run_name
from rewind.flows.cli import main
from rewind.infra import retention
from rewind.infra.catalog import copies, lineage, locations, overview
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, Replica, aware
from rewind.infra.restore import plan

SHAPE = Shape(runs=10, per_run=300, big_run_size=1_500)
BIG, SMALL, FORKED = run_name(1), run_name(2), run_name(fork_run(SHAPE))


@pytest.fixture(scope="module")
def scale() -> Iterator[tuple[Catalog, str]]:
    with database("rewind_scale") as url:
        cat = Catalog(url)
        with cat.engine.begin() as conn:
            build(conn, SHAPE)
        yield cat, url
        cat.close()


def counted(fn: Any) -> tuple[Any, int]:
    with Statements() as st:
        out = fn()
    return out, st.count


def rewind(url: str, monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    monkeypatch.setenv("REWIND_CATALOG_URL", url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


def test_ckpt_list_pages_the_text_keeps_json_whole_and_reads_a_run_in_fixed_statements(scale, monkeypatch):
    cat, url = scale
    every = lineage.checkpoints(cat, BIG)
    text, n_big = counted(lambda: rewind(url, monkeypatch, "ckpt", "list", BIG))
    lines = text.strip().splitlines()
    assert lines[-1] == f"(the newest 50 of {len(every)} checkpoints; --limit N or --all for more)"
    assert [int(ln.split()[1]) for ln in lines[1:-1]] == [c.step for c in every[-50:]]
    _, n_small = counted(lambda: rewind(url, monkeypatch, "ckpt", "list", SMALL))
    assert n_big == n_small <= 6  # the schema check, the run, the page, the count

    whole, n_json = counted(lambda: json.loads(rewind(url, monkeypatch, "ckpt", "list", BIG, "--json")))
    assert [r["id"] for r in whole] == [c.id for c in every]  # every checkpoint, oldest first, as before
    assert n_json <= n_big
    newest = json.loads(rewind(url, monkeypatch, "ckpt", "list", BIG, "--json", "--limit", "3"))
    assert [r["step"] for r in newest] == [c.step for c in every[-3:]]
    assert len(rewind(url, monkeypatch, "ckpt", "list", SMALL, "--all").strip().splitlines()) == 1 + len(
        lineage.checkpoints(cat, SMALL)
    )


def _expected_candidates(cat: Catalog, run: str) -> list[tuple[int, list[str]]]:
    """The row-by-row reading: restorable checkpoints newest first, each with its usable copies nearest first."""
    rows = lineage.restorable(cat, lineage.get_run(cat, run).id)
    reps = copies.copies_of(cat, [c.id for c in rows])
    return [(c.step, [r.tier for r in reps[c.id] if r.status in copies.USABLE_VALUES]) for c in rows]


def test_restore_plan_is_three_statements_for_any_run_and_matches_the_row_by_row_reading(scale, tmp_path):
    cat, _ = scale
    big, n_big = counted(lambda: plan.plan(cat, BIG, root=tmp_path))
    small, n_small = counted(lambda: plan.plan(cat, SMALL, root=tmp_path))
    assert n_big == n_small == 3
    for got, run in ((big, BIG), (small, SMALL)):
        assert [(c.step, [p.tier for p in c.copies]) for c in got.candidates] == _expected_candidates(
            cat, run
        )
    assert len(big.candidates) > 1_000
    corrupt = {c.step for c in lineage.checkpoints(cat, BIG) if c.status == "corrupt"}
    assert corrupt and not corrupt & {c.step for c in big.candidates}  # no copy of theirs could verify

    at = big.candidates[10].step
    (one,) = plan.plan(cat, BIG, root=tmp_path, step=at).candidates
    assert one.step == at
    below = plan.plan(cat, BIG, root=tmp_path, before_step=at, tiers=("shared",)).candidates
    assert below[0].step == big.candidates[11].step
    assert all([p.tier for p in c.copies] == ["shared"] for c in below)


def _expected_keep(cat: Catalog, run: str, policy: retention.Policy) -> set[int]:
    from rewind.infra.catalog import leases

    live = lineage.restorable(cat, lineage.get_run(cat, run).id)
    verified = [c for c in live if c.status == "verified"]
    keep = {c.step for c in verified[: policy.keep_last]} | {
        c.step for c in live if c.step > verified[0].step
    }
    keep |= {c.step for c in live if c.pinned or leases.leased(cat, c.id)}
    return keep | {c.step for c in live if c.step % policy.keep_every == 0}


def test_retention_plan_is_a_few_statements_for_any_run_and_keeps_what_the_rules_say(
    scale, tmp_path, monkeypatch
):
    cat, _ = scale
    # The synthetic catalog has rows, not files: the proof retention makes of what it keeps (reading
    # keep_last checkpoints, tests/test_retention_now.py) is taken as given here, to count the planning.
    monkeypatch.setattr(retention, "_proves_now", lambda cat, checkpoint_id: True)
    policy = retention.Policy(keep_last=3, keep_every=5_000)
    big, n_big = counted(lambda: retention.plan(cat, BIG, policy, root=tmp_path))
    small, n_small = counted(lambda: retention.plan(cat, SMALL, policy, root=tmp_path))
    assert n_big == n_small <= 8  # was one statement per live checkpoint (a lease check each)
    for got, run in ((big, BIG), (small, SMALL)):
        assert set(got.keep) == _expected_keep(cat, run, policy)
        live = {c.step for c in lineage.restorable(cat, lineage.get_run(cat, run).id)}
        assert {r.step for r in got.remove} == live - set(got.keep)
        assert all(r.copies and all(c.status != "deleted" for c in r.copies) for r in got.remove)
    leased = [c for c in lineage.checkpoints(cat, BIG) if c.step == (SHAPE.big_run_size - 5) * 100]
    assert leased[0].step in big.keep  # its restore lease is live; an expired one keeps nothing
    assert (SHAPE.big_run_size - 6) * 100 in {r.step for r in big.remove}

    forked = retention.plan(cat, FORKED, policy, root=tmp_path)
    dead = [c for c in lineage.checkpoints(cat, FORKED) if c.status in ("superseded", "corrupt")]
    assert [(r.checkpoint_id, r.step) for r in forked.reclaim] == [(c.id, c.step) for c in dead]


def _status_row_by_row(cat: Catalog, run: str, now: datetime) -> dict[str, Any]:
    """The overview's answer as it was computed before the totals moved into SQL: every restorable
    checkpoint of the run and every live copy of the verified ones, folded in Python."""
    rows = lineage.restorable(cat, lineage.get_run(cat, run).id)  # newest first
    verified = [c for c in rows if c.status == "verified"]
    newest = verified[0] if verified else None
    unproven = next((c for c in rows if newest is None or c.step > newest.step), None)
    reps = copies.copies_of(cat, [c.id for c in verified])
    tiers: dict[str, dict[str, Any]] = {}
    at: dict[str, datetime] = {}
    for c in verified:
        for r in reps[c.id]:
            if r.status not in overview.LIVE_COPY:
                continue
            t = tiers.setdefault(
                r.tier, {"copies": 0, "verified_copies": 0, "bytes": 0, "newest_verified_step": None}
            )
            t["copies"] += 1
            t["bytes"] += r.bytes or 0
            if r.status == "verified":
                t["verified_copies"] += 1
                if t["newest_verified_step"] is None:
                    t["newest_verified_step"], at[r.tier] = c.step, aware(c.created_at)
    for tier, t in tiers.items():
        if newest is None or t["newest_verified_step"] is None:
            t["lag_steps"] = t["lag_s"] = None
            continue
        t["lag_steps"] = newest.step - t["newest_verified_step"]
        t["lag_s"] = round((aware(newest.created_at) - at[tier]).total_seconds(), 3)
    shown = {
        "newest_verified": None if newest is None else _shown(newest, now),
        "newest_unverified": None if unproven is None else _shown(unproven, now),
        "verified_checkpoints": len(verified),
        "tiers": dict(sorted(tiers.items(), key=lambda kv: copies.TIER_ORDER.get(kv[0], 9))),
    }
    return shown


def _shown(c: Checkpoint, now: datetime) -> dict[str, Any]:
    made = aware(c.created_at)
    age = round((now - made).total_seconds(), 3)
    return {"step": c.step, "checkpoint_id": c.id, "status": c.status, "created_at": made.isoformat(),
            "age_s": age, "bytes": c.total_bytes,
            "save_stall_s": None if c.save_stall_s is None else round(c.save_stall_s, 4)}  # fmt: skip


def _as_before(cat: Catalog, got: dict[str, Any], now: datetime) -> None:
    """Every run of ``got`` says what the row-by-row reading says, key order included (the --json text)."""
    for r in got["runs"]:
        mine = {k: r[k] for k in ("newest_verified", "newest_unverified", "verified_checkpoints", "tiers")}
        want = _status_row_by_row(cat, r["run"], now)
        assert json.dumps(mine) == json.dumps(want), r["run"]


def test_status_of_every_run_is_a_fixed_number_of_statements(scale):
    cat, _ = scale
    now = datetime.now(UTC)
    every, n_all = counted(lambda: overview.status(cat, now=now))
    one, n_one = counted(lambda: overview.status(cat, SMALL, now=now))
    assert n_all == n_one <= 10
    (mine,) = [r for r in every["runs"] if r["run"] == SMALL]
    assert mine == one["runs"][0]
    verified = [c for c in lineage.checkpoints(cat, SMALL) if c.status == "verified"]
    assert mine["verified_checkpoints"] == len(verified)
    assert mine["newest_verified"]["step"] == verified[-1].step
    assert mine["tiers"]["local"]["verified_copies"] == len(verified)
    assert len(every["runs"]) == SHAPE.runs
    _as_before(cat, every, now)


def test_a_dead_copy_whose_key_a_live_checkpoint_took_is_still_in_use(scale):
    """Retention asks this before deleting each copy; the key is matched in SQL now, not over every copy."""
    cat, _ = scale
    with cat.session() as s:
        superseded = s.execute(
            select(Replica.id, Replica.tier)
            .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
            .where(Checkpoint.status == "superseded")
        ).all()
        corrupt_shared = s.scalars(
            select(Replica.id)
            .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
            .where(Checkpoint.status == "corrupt", Replica.tier == "shared")
        ).first()
    shared = [i for i, tier in superseded if tier == "shared"]
    local = [i for i, tier in superseded if tier == "local"]
    assert shared and local and corrupt_shared is not None
    assert all(locations.location_in_use(cat, i) for i in shared)  # the live chain's copy at the same step
    assert not any(locations.location_in_use(cat, i) for i in local)  # its own directory
    assert not locations.location_in_use(cat, corrupt_shared)  # nobody else's key


@pytest.fixture(scope="module")
def varied() -> Iterator[Catalog]:
    """A small catalog with every state the overview distinguishes: verified, committed-only and empty
    runs, corrupt, missing, unverifiable and pending copies, a tier nobody configured with no verified
    copy, copies of unknown size, pins, open and resolved incidents, launches with progress, served models."""
    from rewind.infra.catalog import imported, incidents, jobs, serving

    with database("rewind_status") as url:
        cat = Catalog(url)
        with cat.engine.begin() as conn:
            build(conn, Shape(runs=10, per_run=40))
        lineage.ensure_run(cat, "empty")
        lineage.ensure_run(cat, "committed-only")
        three = [c for c in lineage.checkpoints(cat, run_name(3)) if c.status == "verified"]
        with cat.engine.begin() as conn:  # run 6's restorable checkpoints become a run never verified
            conn.execute(
                text(
                    "UPDATE checkpoint SET status = 'committed', verified_at = NULL,"
                    " run_id = (SELECT id FROM run WHERE name = 'committed-only')"
                    " WHERE run_id = 6 AND status = 'verified'"
                )
            )
        for c, status in zip(three[-4:], ("unverifiable", "corrupt", "missing", "verified"), strict=True):
            copies.add(cat, c.id, "nas", "/mnt/nas", key=None, nbytes=0, status=copies.R(status))
        copies.add(cat, three[-1].id, "tape", "tape://vault", key=None, nbytes=0, status=copies.R.PENDING)
        with cat.engine.begin() as conn:
            conn.execute(text("UPDATE replica SET bytes = NULL WHERE tier = 'tape' OR id % 11 = 0"))
            conn.execute(
                text("UPDATE replica SET status = 'unverifiable' WHERE tier = 'shared' AND id % 7 = 0")
            )
        imported.pin(cat, three[-2].id)
        launch = jobs.begin_launch(cat, run_name(3), {"command": ["train"]}, {"world_size": 2})
        made = aware(three[-1].created_at).timestamp()
        for rank, step in ((0, three[-1].step + 7), (1, None)):
            jobs.report(cat, launch, rank, node="n0", pid=1, step=step, step_at=made + 9.5, beat_at=made + 10)
        jobs.end_launch(cat, jobs.begin_launch(cat, run_name(2), {}, {}), 1)
        incidents.open_incident(cat, "committed-only", "hang", "no progress\n after step 300")
        for version, ck in (("1", three[-1]), ("2", lineage.checkpoints(cat, run_name(3))[0])):
            serving.add_version(
                cat, model="m", version=version, checkpoint_id=ck.id, run=run_name(3), step=ck.step,
                manifest_digest="0" * 64, artifact_uri="file:///m.mar", artifact_digest="0" * 64,
                artifact_bytes=1, state="stable" if version == "1" else "retired", weight=100,
            )  # fmt: skip
        yield cat
        cat.close()


def test_status_totals_from_sql_say_what_the_row_by_row_reading_says_on_every_kind_of_run(varied):
    now = datetime.now(UTC)
    got, n_all = counted(lambda: overview.status(varied, now=now))
    _as_before(varied, got, now)
    runs = {r["run"]: r for r in got["runs"]}
    assert len(runs) == 12
    empty, never, dead = runs["empty"], runs["committed-only"], runs[run_name(6)]
    assert empty["newest_verified"] is empty["newest_unverified"] is empty["job"] is None
    assert (empty["verified_checkpoints"], empty["tiers"], empty["open_incidents"]) == (0, {}, [])
    assert never["newest_verified"] is None and never["newest_unverified"]["status"] == "committed"
    assert (never["verified_checkpoints"], never["tiers"]) == (0, {})  # copies of unproven ones not counted
    assert never["open_incidents"][0]["reason"] == "no progress\n after step 300"
    assert dead["newest_verified"] is dead["newest_unverified"] is None  # only dead checkpoints left

    three = runs[run_name(3)]
    assert list(three["tiers"]) == ["local", "shared", "offsite", "nas", "tape"]
    nas, tape = three["tiers"]["nas"], three["tiers"]["tape"]
    assert (nas["copies"], nas["verified_copies"], nas["lag_steps"]) == (2, 1, 0)  # corrupt, missing: gone
    assert (tape["copies"], tape["newest_verified_step"], tape["lag_s"], tape["bytes"]) == (1, None, None, 0)
    assert three["rpo"]["steps"] == 7 and three["job"]["ranks"] == 2 and three["job"]["running"]
    assert runs[run_name(2)]["job"]["exit_code"] == 1 and runs[run_name(2)]["rpo"]["steps"] is None
    assert runs[run_name(4)]["newest_unverified"]["status"] == "committed"
    assert [(v["version"], v["checkpoint_status"]) for v in got["models"][0]["versions"]] == [
        ("1", "verified"),
        ("2", "deleted"),
    ]

    one, n_one = counted(lambda: overview.status(varied, run_name(3), now=now))
    assert one["runs"] == [three] and one["models"] == got["models"] and n_one == n_all


def test_a_run_past_postgres_parameter_limit_is_listed_for_a_scrub_read_and_rebuilt(monkeypatch):
    """80,000 checkpoints in one run: every statement that bound one parameter per checkpoint failed
    (Postgres takes at most 65,535); the scrub's list, copies_of and a rebuild's retirement now work."""
    from rewind.infra.catalog import imported
    from rewind.tasks.verify import list_checkpoints

    with database("rewind_params") as url:
        cat = Catalog(url)
        run_id = lineage.ensure_run(cat, "long")
        with cat.engine.begin() as conn:  # steps past 66,000 were written before step 2: abandoned
            conn.execute(
                text(
                    "INSERT INTO checkpoint (run_id, step, status, status_reason, path, layout, environment,"
                    " metrics, pinned, created_at, updated_at)"
                    " SELECT :run, i, CASE WHEN i IN (5, 6, 7) THEN 'corrupt' ELSE 'committed' END,"
                    " CASE i WHEN 6 THEN 'content: does not load' END, '/c/step-' || i, '{}', '{}', '{}', false,"
                    " now() + (CASE WHEN i > 66000 THEN i - 66000 ELSE i END) * interval '1 second', now()"
                    " FROM generate_series(1, 80000) AS i"
                ),
                {"run": run_id},
            )
            conn.execute(
                text(
                    "INSERT INTO replica (checkpoint_id, tier, uri, status, bytes, created_at)"
                    " SELECT id, 'local', path, CASE step WHEN 7 THEN 'corrupt' ELSE 'pending' END, 1, now()"
                    " FROM checkpoint WHERE step IN (5, 6, 7)"
                )
            )
        monkeypatch.setenv("REWIND_CATALOG_URL", url)
        listed = list_checkpoints.fn("long")
        assert [c["step"] for c in listed] == [s for s in range(1, 80_001) if s not in (6, 7)]
        ids = [c.id for c in lineage.checkpoints(cat, "long")]
        found = copies.copies_of(cat, ids)
        assert len(found) == 80_000 and sum(len(r) for r in found.values()) == 3

        adopted = ids[2:65_999]  # steps 3..65,999: more exempt ids than one statement may bind
        gone = imported.retire_abandoned(cat, run_id, ids, exempt=adopted)
        assert sorted(gone) == ids[66_000:]  # 14,000: more than one batch of MAX_IDS
        assert {c.status for c in lineage.checkpoints(cat, "long") if c.step > 66_000} == {"superseded"}
        cat.close()
