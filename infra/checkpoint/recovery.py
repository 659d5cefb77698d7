"""Choosing where a run goes back to: plan first (a pure read of the catalog), then execute.

The plan lists the candidates newest first; executing it deep-verifies them in
that order, marks each failure corrupt, and stops at the first that passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.checkpoint.audit import verify_recorded
from infra.errors import CorruptCheckpoint, NoRestorableCheckpoint, NotFoundError


@dataclass(frozen=True, slots=True)
class Candidate:
    checkpoint_id: int
    step: int
    path: str
    status: str


@dataclass(frozen=True, slots=True)
class Plan:
    run: str
    candidates: tuple[Candidate, ...]
    pinned_step: int | None  # the user asked for exactly this step


@dataclass(frozen=True, slots=True)
class Chosen:
    checkpoint_id: int
    step: int
    path: str
    skipped: tuple[tuple[int, str], ...]  # (step, why) for each candidate that failed


def plan(cat: Catalog, run: str, step: int | None = None, *, before_step: int | None = None) -> Plan:
    """Candidates newest first: exactly ``step``, or any step below ``before_step`` (an anomaly), or all."""
    run_id = lineage.get_run(cat, run).id
    rows = lineage.restorable(cat, run_id)
    if before_step is not None:
        rows = [r for r in rows if r.step < before_step]
    if step is not None:
        rows = [r for r in rows if r.step == step]
        if not rows:
            raise NotFoundError(f"run {run!r} has no committed checkpoint at step {step}")
    return Plan(run, tuple(Candidate(r.id, r.step, r.path, r.status) for r in rows), step)


def execute(cat: Catalog, p: Plan) -> Chosen:
    skipped: list[tuple[int, str]] = []
    for c in p.candidates:
        ck = lineage.get_checkpoint(cat, c.checkpoint_id)
        report = verify_recorded(cat, ck, deep=True)
        if report.ok:
            return Chosen(c.checkpoint_id, c.step, c.path, tuple(skipped))
        fatal = [f for f in report.findings if f.fatal]
        if p.pinned_step is not None:
            raise CorruptCheckpoint(c.path, fatal)
        skipped.append((c.step, "; ".join(str(f) for f in fatal)))
    raise NoRestorableCheckpoint(f"no checkpoint of run {p.run!r} verifies ({len(skipped)} tried)")


def roll_back_to(cat: Catalog, run: str, chosen: Chosen, reason: str) -> list[int]:
    """Make ``chosen`` the newest restorable checkpoint of the run."""
    return lineage.supersede_after(cat, lineage.get_run(cat, run).id, chosen.step, reason)


def data_position(directory: Path) -> dict[str, int]:
    """The data loader position a checkpoint recorded (its ``data`` state: epoch and samples consumed)."""
    tree = json.loads((directory / "state.json").read_text())
    data = tree.get("data") or {}
    return {"epoch": int(data.get("epoch", 0)), "consumed": int(data.get("consumed", 0))}
