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

from infra.catalog.db import Catalog
from infra.catalog.models import ChatSession, ChatTurn, aware, utcnow
from infra.errors import ConfigError

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
    instance: str | None = None,
    ttl_s: float = DEFAULT_TTL_S,
) -> int:
    """Append one turn (and the blocks that now cover it); returns its number. The TTL restarts."""
    _check_key(key)
    session_id = _session_row(cat, key, model, ttl_s)
    now = utcnow()
    with cat.session() as s:
        row = s.scalar(select(ChatSession).where(ChatSession.id == session_id).with_for_update())
        assert row is not None
        n = (s.scalar(select(func.max(ChatTurn.n)).where(ChatTurn.session_id == session_id)) or 0) + 1
        s.add(ChatTurn(session_id=session_id, n=n, prompt=prompt, reply=reply, instance=instance))
        row.tokens = [*row.tokens, *prompt, *reply]
        row.blocks = [b.as_list() for b in blocks]
        row.last_turn_at, row.expires_at = now, now + timedelta(seconds=ttl_s)
    return n


def expire(cat: Catalog, *, now: datetime | None = None) -> int:
    """Delete every conversation past its TTL (turns first); returns how many."""
    cutoff = now or utcnow()
    with cat.session() as s:
        gone = list(s.scalars(select(ChatSession.id).where(ChatSession.expires_at <= cutoff)))
        if gone:
            s.execute(delete(ChatTurn).where(ChatTurn.session_id.in_(gone)))
            s.execute(delete(ChatSession).where(ChatSession.id.in_(gone)))
    return len(gone)
