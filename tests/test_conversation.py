"""Conversations that outlive their instance: history in the catalog, KV-cache blocks in tiers, checked on read.

Instances here are engines in this process with their own memory; what they share is what two
TorchServe instances on one node share: the catalog (Postgres) and the node-local block directory.
"""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest

from examples.chat_lm import build_model
from infra.catalog import sessions
from infra.catalog.db import Catalog
from infra.catalog.models import utcnow
from infra.serving import kv_blocks
from infra.serving.conversation import Conversations
from infra.serving.kv_blocks import DiskBlocks, MemoryBlocks, TieredBlocks

SEED = 20261130
MiB = 1 << 20


@pytest.fixture(scope="module")
def model():
    return build_model(seed=0)


def instance(model, cat: Catalog, node_dir: Path, name: str) -> Conversations:
    tiers = TieredBlocks([MemoryBlocks(64 * MiB), DiskBlocks(node_dir, 256 * MiB)])
    return Conversations(model, catalog=cat, blocks=tiers, model_name="chat", instance=name)


def turns(seed: int, n: int, long_first: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(long_first if i == 0 else 24)] for i in range(n)]


def test_a_conversation_continues_on_another_instance_with_the_same_reply(model, pg_url, tmp_path):
    print(f"seed {SEED}")
    cat = Catalog(pg_url)
    prompts = turns(SEED, 3, long_first=2000)
    a = instance(model, cat, tmp_path / "node", "a")
    reference = instance(model, cat, tmp_path / "ref-node", "ref")
    for p in prompts[:2]:
        a.turn("s-failover", p, max_new_tokens=16)
        reference.turn("s-reference", p, max_new_tokens=16)
    expected = reference.turn("s-reference", prompts[2], max_new_tokens=16)
    assert expected.source == "process"

    a.forget("s-failover")  # instance A is gone; B on the same node takes the conversation over
    b = instance(model, cat, tmp_path / "node", "b")
    got = b.turn("s-failover", prompts[2], max_new_tokens=16)
    assert got.tokens == expected.tokens  # the reply an uninterrupted conversation gives
    assert got.source == "blocks (disk)" and got.recomputed_tokens == 0, got
    assert got.reused_tokens > 2000 and got.turn == 3
    conv = sessions.load(cat, "s-failover")
    assert conv is not None and conv.turns == 3 and len(conv.tokens) == 2000 + 24 * 2 + 16 * 3


def test_a_damaged_block_is_recomputed_never_used(model, pg_url, tmp_path):
    cat = Catalog(pg_url)
    prompts = turns(SEED + 1, 2, long_first=700)
    reference = instance(model, cat, tmp_path / "ref-node", "ref")
    a = instance(model, cat, tmp_path / "node", "a")
    for p in prompts[:1]:
        a.turn("s-damaged", p, max_new_tokens=8)
        reference.turn("s-damaged-ref", p, max_new_tokens=8)
    conv = sessions.load(cat, "s-damaged")
    assert conv is not None
    victim = conv.blocks[5]
    path = tmp_path / "node" / victim.name[:2] / victim.name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    a.forget("s-damaged")
    b = instance(model, cat, tmp_path / "node", "b")
    got = b.turn("s-damaged", prompts[1], max_new_tokens=8)
    assert got.refused_blocks == 1 and got.reused_tokens == victim.end - 64  # blocks before it only
    assert got.recomputed_tokens == len(conv.tokens) - 1 - got.reused_tokens
    assert len(got.tokens) == 8
    again = sessions.load(cat, "s-damaged")  # B wrote the block again, and the catalog names those bytes
    assert again is not None and again.blocks[5].digest == kv_blocks.digest(path.read_bytes())


def test_history_expires_after_its_ttl(pg_url):
    cat = Catalog(pg_url)
    sessions.record_turn(cat, "s-ttl", "chat", prompt=[1, 2], reply=[3], blocks=[], ttl_s=60)
    assert sessions.load(cat, "s-ttl") is not None
    later = utcnow() + timedelta(seconds=61)
    assert sessions.load(cat, "s-ttl", now=later) is None  # expired is gone for readers at once
    assert sessions.expire(cat, now=later) >= 1
    assert sessions.load(cat, "s-ttl") is None
