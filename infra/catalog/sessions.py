"""Conversations in the catalog: every turn recorded before its reply leaves, gone after a TTL.

The serving process keeps nothing it cannot lose: the tokens of a conversation and the
names and digests of its KV-cache blocks are here, so another instance can take the
conversation over (its blocks checked against these digests before use).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ChatSession, ChatTurn, aware, utcnow
from rewind.infra.errors import ConfigError, Refused

DEFAULT_TTL_S = 24 * 3600.0
MAX_KEY = 200


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One full KV-cache block: its name (chained hash of the token prefix), content digest, last token + 1."""

    name: str
    digest: str
    end: int

    def as_list(self) -> list[str | int]:
        return [self.name, self.digest, self.end]


@dataclass(frozen=True, slots=True)
class Conversation:
    key: str
    model: str
    tokens: list[int]
    blocks: list[BlockRef]
    turns: int


def _check_key(key: str) -> None:
    if not key or len(key) > MAX_KEY or any(ord(c) < 32 for c in key):
        raise ConfigError(f"a session_id is 1 to {MAX_KEY} printable characters, not {key[:40]!r}")


def load(cat: Catalog, key: str, *, now: datetime | None = None) -> Conversation | None:
    """The conversation so far, or None (never started, or expired)."""
    _check_key(key)
    with cat.session() as s:
        row = s.scalar(select(ChatSession).where(ChatSession.session_key == key))
        if row is None or aware(row.expires_at) <= (now or utcnow()):
            return None
        turns = s.scalar(select(func.count()).where(ChatTurn.session_id == row.id)) or 0
        blocks = [BlockRef(str(b[0]), str(b[1]), int(b[2])) for b in row.blocks]
        return Conversation(row.session_key, row.model, list(row.tokens), blocks, int(turns))


def _session_row(cat: Catalog, key: str, model: str, ttl_s: float) -> int:
    """The id of the session row, created if need be (two instances racing: one insert wins)."""
    with cat.session() as s:
        found = s.scalar(select(ChatSession.id).where(ChatSession.session_key == key))
        if found is not None:
            return int(found)
    try:
        with cat.session() as s:
            row = ChatSession(
                session_key=key,
                model=model,
                tokens=[],
                blocks=[],
                expires_at=utcnow() + timedelta(seconds=ttl_s),
            )
            s.add(row)
            s.flush()
            return int(row.id)
    except IntegrityError:
        return _session_row(cat, key, model, ttl_s)


def record_turn(
    cat: Catalog,
    key: str,
    model: str,
    *,
    prompt: list[int],
    reply: list[int],
    blocks: list[BlockRef],
    history_len: int,
    instance: str | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    expect: int | None = None,
) -> int:
    """Append one turn (and the blocks that now cover it) to a conversation of ``history_len`` tokens;
    returns its number. The TTL restarts.

    ``Refused`` if the conversation is not the one the reply was computed from (another request
    added a turn meanwhile, or it belongs to another model), or, with ``expect``, if the turn would
    not get that number.
    """
    _check_key(key)
    for _ in range(3):  # the row may vanish between finding and locking it (expired and deleted)
        session_id = _session_row(cat, key, model, ttl_s)
        try:
            with cat.session() as s:
                row = s.scalar(select(ChatSession).where(ChatSession.id == session_id).with_for_update())
                if row is None:
                    continue
                return _append(s, row, model, prompt, reply, blocks, history_len, instance, ttl_s, expect)
        except IntegrityError as exc:  # SQLite: two writers numbered the same turn
            raise Refused(f"session {key}: another request answered this turn meanwhile") from exc
    raise Refused(f"session {key}: deleted while this turn was recorded")


def _append(
    s: Session,
    row: ChatSession,
    model: str,
    prompt: list[int],
    reply: list[int],
    blocks: list[BlockRef],
    history_len: int,
    instance: str | None,
    ttl_s: float,
    expect: int | None,
) -> int:
    now = utcnow()
    if aware(row.expires_at) <= now:  # expired but not yet cleaned up: a new conversation under the old key
        s.execute(delete(ChatTurn).where(ChatTurn.session_id == row.id))
        row.tokens, row.blocks = [], []
        row.model = model
    elif row.model != model:
        raise Refused(f"session {row.session_key} is a conversation with {row.model}, not {model}")
    if len(row.tokens) != history_len:
        raise Refused(
            f"session {row.session_key}: another request added a turn meanwhile; this reply is not kept"
        )
    n = (s.scalar(select(func.max(ChatTurn.n)).where(ChatTurn.session_id == row.id)) or 0) + 1
    if expect is not None and n != expect:
        raise Refused(f"session {row.session_key}: turn {expect} was answered by another request meanwhile")
    s.add(ChatTurn(session_id=row.id, n=n, prompt=prompt, reply=reply, instance=instance))
    s.flush()
    row.tokens = [*row.tokens, *prompt, *reply]
    row.blocks = [b.as_list() for b in blocks]
    row.last_turn_at, row.expires_at = now, now + timedelta(seconds=ttl_s)
    return n


def recorded_turn(cat: Catalog, key: str, n: int) -> tuple[list[int], list[int]] | None:
    """(prompt, reply) of turn ``n``, if it was recorded."""
    with cat.session() as s:
        row = s.execute(
            select(ChatTurn.prompt, ChatTurn.reply)
            .join(ChatSession, ChatSession.id == ChatTurn.session_id)
            .where(ChatSession.session_key == key, ChatTurn.n == n)
        ).first()
    return None if row is None else (list(row[0]), list(row[1]))


def expire(cat: Catalog, *, now: datetime | None = None) -> int:
    """Delete every conversation past its TTL (turns first); returns how many."""
    cutoff = now or utcnow()
    with cat.session() as s:  # the condition is evaluated again at delete: a turn that renewed it keeps it
        stale = select(ChatSession.id).where(ChatSession.expires_at <= cutoff).scalar_subquery()
        s.execute(delete(ChatTurn).where(ChatTurn.session_id.in_(stale)))
        gone = s.scalars(
            delete(ChatSession).where(ChatSession.expires_at <= cutoff).returning(ChatSession.id)
        )
        return len(list(gone))
