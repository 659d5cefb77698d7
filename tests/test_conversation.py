"""Conversations that outlive their instance: history in the catalog, KV-cache blocks in tiers, checked on read.

Instances here are engines in this process with their own memory; what they share is what two
TorchServe instances on one node share: the catalog (Postgres) and the node-local block directory.
"""

from __future__ import annotations

import random
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from rewind.examples.chat_lm import build_model
from rewind.infra.catalog import sessions
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import utcnow
from rewind.infra.serving import kv_blocks
from rewind.infra.serving.conversation import Conversations
from rewind.infra.serving.kv_blocks import DiskBlocks, MemoryBlocks, TieredBlocks

SEED = 20261130
MiB = 1 << 20


@pytest.fixture(scope="module")
def model():
    return build_model(seed=0)


def instance(model, cat: Catalog, node_dir: Path, name: str, model_id: str = "chat@1") -> Conversations:
    tiers = TieredBlocks([MemoryBlocks(64 * MiB), DiskBlocks(node_dir, 256 * MiB)])
    return Conversations(
        model, catalog=cat, blocks=tiers, model_name="chat", instance=name, model_id=model_id
    )


@pytest.fixture
def key() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"


def turns(seed: int, n: int, long_first: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(long_first if i == 0 else 24)] for i in range(n)]


def test_a_conversation_continues_on_another_instance_with_the_same_reply(model, pg_url, tmp_path, key):
    print(f"seed {SEED}")
    cat = Catalog(pg_url)
    prompts = turns(SEED, 3, long_first=2000)
    a = instance(model, cat, tmp_path / "node", "a")
    reference = instance(model, cat, tmp_path / "ref-node", "ref")
    for p in prompts[:2]:
        a.turn(key, p, max_new_tokens=16)
        reference.turn(key + "-ref", p, max_new_tokens=16)
    expected = reference.turn(key + "-ref", prompts[2], max_new_tokens=16)
    assert expected.source == "process"

    a.forget(key)  # instance A is gone; B on the same node takes the conversation over
    b = instance(model, cat, tmp_path / "node", "b")
    got = b.turn(key, prompts[2], max_new_tokens=16)
    assert got.tokens == expected.tokens  # the reply an uninterrupted conversation gives
    assert got.source == "blocks (disk)" and got.recomputed_tokens == 0, got
    assert got.reused_tokens > 2000 and got.turn == 3
    conv = sessions.load(cat, key)
    assert conv is not None and conv.turns == 3 and len(conv.tokens) == 2000 + 24 * 2 + 16 * 3


def test_a_damaged_block_is_recomputed_never_used(model, pg_url, tmp_path, key):
    cat = Catalog(pg_url)
    prompts = turns(SEED + 1, 2, long_first=700)
    reference = instance(model, cat, tmp_path / "ref-node", "ref")
    a = instance(model, cat, tmp_path / "node", "a")
    for p in prompts[:1]:
        a.turn(key, p, max_new_tokens=8)
        reference.turn(key + "-ref", p, max_new_tokens=8)
    conv = sessions.load(cat, key)
    assert conv is not None
    victim = conv.blocks[5]
    path = tmp_path / "node" / victim.name[:2] / f"{victim.name}-{victim.digest}"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    a.forget(key)
    b = instance(model, cat, tmp_path / "node", "b")
    got = b.turn(key, prompts[1], max_new_tokens=8)
    assert got.refused_blocks == 1 and got.reused_tokens == victim.end - 64  # blocks before it only
    assert got.recomputed_tokens == len(conv.tokens) - 1 - got.reused_tokens
    assert len(got.tokens) == 8
    again = sessions.load(cat, key)  # B wrote the block again, and the catalog names those bytes
    assert again is not None
    fresh = again.blocks[5]
    rewritten = tmp_path / "node" / fresh.name[:2] / f"{fresh.name}-{fresh.digest}"
    assert fresh.name == victim.name and kv_blocks.digest(rewritten.read_bytes()) == fresh.digest


def test_history_expires_after_its_ttl(pg_url, key):
    cat = Catalog(pg_url)
    sessions.record_turn(cat, key, "chat", prompt=[1, 2], reply=[3], blocks=[], history_len=0, ttl_s=60)
    assert sessions.load(cat, key) is not None
    later = utcnow() + timedelta(seconds=61)
    assert sessions.load(cat, key, now=later) is None  # expired is gone for readers at once
    assert sessions.expire(cat, now=later) >= 1
    assert sessions.load(cat, key) is None


def test_a_retried_turn_gets_its_recorded_reply_not_a_second_turn(model, pg_url, tmp_path, key):
    from rewind.infra.errors import Refused

    cat = Catalog(pg_url)
    a = instance(model, cat, tmp_path / "node", "a")
    first = a.turn(key, [7] * 40, max_new_tokens=4, number=1)
    again = instance(model, cat, tmp_path / "node", "b").turn(key, [7] * 40, max_new_tokens=4, number=1)
    assert again.source == "recorded" and again.tokens == first.tokens and again.turn == 1
    conv = sessions.load(cat, key)
    assert conv is not None and conv.turns == 1 and len(conv.tokens) == 44  # answered once
    with pytest.raises(Refused):
        a.turn(key, [8] * 3, max_new_tokens=4, number=3)  # a turn from the future


def test_blocks_of_other_weights_or_a_stale_history_are_never_used(model, pg_url, tmp_path, key):
    from rewind.infra.errors import Refused

    cat = Catalog(pg_url)
    a = instance(model, cat, tmp_path / "node", "a", model_id="chat@1")
    a.turn(key, [3] * 300, max_new_tokens=4)
    a.forget(key)
    rolled = instance(model, cat, tmp_path / "node", "b", model_id="chat@2")  # a new version's weights
    got = rolled.turn(key, [4] * 10, max_new_tokens=4)
    assert got.source == "recompute" and got.reused_tokens == 0  # names differ: nothing of 1's KV is used
    with pytest.raises(Refused):  # a reply computed from a history another request has since extended
        sessions.record_turn(cat, key, "chat", prompt=[1], reply=[2], blocks=[], history_len=300)
    with pytest.raises(Refused):
        sessions.record_turn(cat, key, "other-model", prompt=[1], reply=[2], blocks=[], history_len=318)
