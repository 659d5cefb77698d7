"""Serving versions and rollouts in the catalog: which version serves, where it came from, every step taken.

State changes are guarded single statements (``UPDATE ... WHERE state IN (...)``),
and promotion moves the old stable version aside and the new one in within one
transaction, so the one-stable-per-model index holds under racing flows.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from rewind.infra.catalog.db import Catalog, changed
from rewind.infra.catalog.models import (
    Rollout,
    RolloutKind,
    RolloutState,
    RolloutStep,
    ServingVersion,
    utcnow,
)
from rewind.infra.catalog.models import VersionState as V
from rewind.infra.errors import NotFoundError

# Loaded in the model server (taking traffic or ready to).
LOADED = (V.LOADED, V.CANARY, V.STABLE, V.PREVIOUS)
# A version that ever served all traffic and was not rolled back since: a rollback needs no gates.
KNOWN_GOOD = (V.STABLE, V.PREVIOUS, V.RETIRED)
# Versions whose checkpoint retention keeps: loaded, rollback-ready, or exported and about to load.
KEEPS_CHECKPOINT = (*LOADED, V.RETIRED, V.EXPORTED)


def add_version(cat: Catalog, **fields: Any) -> int:
    with cat.session() as s:
        row = ServingVersion(**fields)
        s.add(row)
        s.flush()
        return row.id


def next_version(cat: Catalog, model: str) -> str:
    """One more than the highest numeric version of ``model`` ("1" for a new model)."""
    with cat.session() as s:
        names = s.scalars(select(ServingVersion.version).where(ServingVersion.model == model)).all()
    return str(max((int(n) for n in names if n.isdigit()), default=0) + 1)


def get_version(cat: Catalog, model: str, version: str) -> ServingVersion:
    with cat.session() as s:
        row = s.scalar(
            select(ServingVersion).where(ServingVersion.model == model, ServingVersion.version == version)
        )
    if row is None:
        raise NotFoundError(f"model {model!r} has no version {version!r}")
    return row


def find_version(
    cat: Catalog, model: str, *, version: str | None, run: str, step: int
) -> ServingVersion | None:
    """``version`` if it exists, else the newest live version exported from ``run@step``.

    A retried deploy, or a rollout of a checkpoint already deployed at weight 0, reuses
    that version; one that was rolled back or retired is not reused: a new rollout of
    the same checkpoint gets a new version (and a fresh archive).
    """
    reusable = (V.EXPORTED, V.FAILED, V.LOADED, V.STABLE)
    with cat.session() as s:
        q = select(ServingVersion).where(ServingVersion.model == model)
        if version is not None:
            q = q.where(ServingVersion.version == version)
        else:
            q = q.where(
                ServingVersion.run == run,
                ServingVersion.step == step,
                ServingVersion.state.in_([r.value for r in reusable]),
            )
        return s.scalars(q.order_by(ServingVersion.id.desc())).first()


def versions(cat: Catalog, model: str, states: Iterable[str] | None = None) -> list[ServingVersion]:
    """Versions of ``model``, oldest first; NotFoundError for a model Rewind has never exported."""
    with cat.session() as s:
        q = select(ServingVersion).where(ServingVersion.model == model)
        rows = list(s.scalars(q.order_by(ServingVersion.id)))
    if not rows:
        raise NotFoundError(f"unknown model {model!r}: nothing was ever deployed under that name")
    if states is not None:
        wanted = {str(x) for x in states}
        rows = [r for r in rows if r.state in wanted]
    return rows


def stable(cat: Catalog, model: str) -> ServingVersion | None:
    rows = versions(cat, model, (V.STABLE,))
    return rows[0] if rows else None


def packaging(cat: Catalog, model: str) -> tuple[str, list[str]] | None:
    """The handler and extra files of the stable version (else the newest that recorded one)."""
    with cat.session() as s:
        rows = s.scalars(
            select(ServingVersion)
            .where(ServingVersion.model == model, ServingVersion.handler.is_not(None))
            .order_by((ServingVersion.state == V.STABLE.value).desc(), ServingVersion.id.desc())
        ).all()
    return (str(rows[0].handler), list(rows[0].extra_files or [])) if rows else None


def set_state(
    cat: Catalog, model: str, version: str, to: V, *, expect: Iterable[V] | None = None, **fields: Any
) -> bool:
    """Move a version to ``to`` if it is in one of ``expect`` (any state if None); True if it moved."""
    values: dict[str, Any] = {"state": to.value, **fields}
    if to == V.LOADED:
        values.setdefault("loaded_at", utcnow())
    if to in (V.RETIRED, V.ROLLED_BACK, V.FAILED, V.EXPORTED):
        values.setdefault("unloaded_at", utcnow())
        values.setdefault("weight", 0)
    if to == V.ROLLED_BACK:
        values.setdefault("was_stable", False)  # it misbehaved: no longer a gate-free rollback target
    with cat.session() as s:
        q = update(ServingVersion).where(ServingVersion.model == model, ServingVersion.version == version)
        if expect is not None:
            q = q.where(ServingVersion.state.in_([e.value for e in expect]))
        return changed(s.execute(q.values(**values))) == 1


def set_weights(cat: Catalog, model: str, weights: dict[str, int]) -> None:
    with cat.session() as s:
        for version, weight in weights.items():
            s.execute(
                update(ServingVersion)
                .where(ServingVersion.model == model, ServingVersion.version == version)
                .values(weight=weight)
            )


def promote(cat: Catalog, model: str, version: str) -> str | None:
    """Make ``version`` the stable one; the old stable becomes ``previous``. Returns the old stable."""
    now = utcnow()
    with cat.session() as s:
        old = s.scalar(
            select(ServingVersion.version).where(
                ServingVersion.model == model, ServingVersion.state == V.STABLE.value
            )
        )
        if old is not None and old != version:
            s.execute(
                update(ServingVersion)
                .where(ServingVersion.model == model, ServingVersion.version == old)
                .values(state=V.PREVIOUS.value, weight=0)
            )
        won = changed(
            s.execute(
                update(ServingVersion)
                .where(
                    ServingVersion.model == model,
                    ServingVersion.version == version,
                    ServingVersion.state.in_([v.value for v in LOADED]),
                )
                .values(state=V.STABLE.value, weight=100, was_stable=True, promoted_at=now)
            )
        )
        if won != 1:
            raise NotFoundError(f"{model} {version} is not loaded; it cannot become stable")
    return old if old != version else None


def protected_checkpoints(cat: Catalog) -> set[int]:
    """Checkpoints a loaded (or rollback-ready) serving version points at: retention keeps them."""
    with cat.session() as s:
        ids = s.scalars(
            select(ServingVersion.checkpoint_id).where(
                ServingVersion.state.in_([k.value for k in KEEPS_CHECKPOINT]),
                ServingVersion.checkpoint_id.is_not(None),
            )
        ).all()
    return {int(i) for i in ids if i is not None}


# -- rollouts ----------------------------------------------------------------------


def begin_rollout(
    cat: Catalog,
    model: str,
    kind: str,
    to_version: str,
    *,
    from_version: str | None,
    triggered_by: str,
    params: dict[str, Any] | None = None,
    origin: str | None = None,
) -> int:
    """A new rollout record; with an ``origin`` that another caller just recorded, that one."""
    try:
        with cat.session() as s:
            row = Rollout(
                model=model,
                kind=RolloutKind(kind),
                to_version=to_version,
                from_version=from_version,
                triggered_by=triggered_by,
                params=params or {},
                origin=origin,
            )
            s.add(row)
            s.flush()
            return row.id
    except IntegrityError:
        known = rollout_by_origin(cat, str(origin))
        if known is None:
            raise
        return known


def rollout_by_origin(cat: Catalog, origin: str) -> int | None:
    with cat.session() as s:
        return s.scalar(select(Rollout.id).where(Rollout.origin == origin))


def record_step(
    cat: Catalog,
    rollout_id: int,
    action: str,
    *,
    actor: str,
    weights: dict[str, int] | None = None,
    gates: dict[str, Any] | None = None,
    passed: bool | None = None,
    detail: str | None = None,
) -> None:
    with cat.session() as s:
        s.add(
            RolloutStep(
                rollout_id=rollout_id,
                action=action,
                actor=actor,
                weights=weights,
                gates=gates,
                passed=passed,
                detail=detail,
            )
        )


def finish_rollout(
    cat: Catalog,
    rollout_id: int,
    state: str,
    *,
    reason: str | None = None,
    decided_at: datetime | None = None,
    switch_s: float | None = None,
) -> str:
    """Close a running rollout; returns the state it has now. One already closed (a manual rollback
    took over) keeps its state: the loop that finishes late must not overwrite it."""
    with cat.session() as s:
        s.execute(
            update(Rollout)
            .where(Rollout.id == rollout_id, Rollout.state == RolloutState.RUNNING.value)
            .values(
                state=state, reason=reason, decided_at=decided_at, switch_s=switch_s, finished_at=func.now()
            )
        )
        return str(s.scalar(select(Rollout.state).where(Rollout.id == rollout_id)))


def models(cat: Catalog) -> list[str]:
    with cat.session() as s:
        return sorted(set(s.scalars(select(ServingVersion.model)).all()))


def running_rollouts(cat: Catalog, model: str | None = None) -> list[Rollout]:
    """Rollouts still in progress, of one model or (None) of every model."""
    with cat.session() as s:
        q = select(Rollout).where(Rollout.state == "running")
        if model is not None:
            q = q.where(Rollout.model == model)
        return list(s.scalars(q.order_by(Rollout.id)))


def get_rollout(cat: Catalog, rollout_id: int) -> Rollout:
    return cat.get(Rollout, rollout_id, "rollout")


def rollouts(cat: Catalog, model: str) -> list[Rollout]:
    with cat.session() as s:
        return list(s.scalars(select(Rollout).where(Rollout.model == model).order_by(Rollout.id)))


def steps_of(cat: Catalog, rollout_id: int) -> list[RolloutStep]:
    with cat.session() as s:
        return list(
            s.scalars(
                select(RolloutStep).where(RolloutStep.rollout_id == rollout_id).order_by(RolloutStep.id)
            )
        )
