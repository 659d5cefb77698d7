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
from sqlalchemy import select

from bench.catalog_scale import Statements, database
from bench.synthetic_catalog import Shape, build, fork_run, run_name
from flows.cli import main
from infra import retention
from infra.catalog import copies, lineage, overview
from infra.catalog.db import Catalog
from infra.catalog.models import Checkpoint, Replica
from infra.restore import plan

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
    from infra.catalog import leases

    live = lineage.restorable(cat, lineage.get_run(cat, run).id)
    verified = [c for c in live if c.status == "verified"]
    keep = {c.step for c in verified[: policy.keep_last]} | {
        c.step for c in live if c.step > verified[0].step
    }
    keep |= {c.step for c in live if c.pinned or leases.leased(cat, c.id)}
    return keep | {c.step for c in live if c.step % policy.keep_every == 0}


def test_retention_plan_is_a_few_statements_for_any_run_and_keeps_what_the_rules_say(scale, tmp_path):
    cat, _ = scale
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
    assert all(copies.location_in_use(cat, i) for i in shared)  # the live chain's copy at the same step
    assert not any(copies.location_in_use(cat, i) for i in local)  # its own directory
    assert not copies.location_in_use(cat, corrupt_shared)  # nobody else's key
