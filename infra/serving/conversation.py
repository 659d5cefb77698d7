"""Conversations that outlive the instance serving them: history in the catalog, KV cache in tiers.

A turn: the conversation so far comes from the catalog (``infra.catalog.sessions``); its KV
cache from this process if it holds it, else from the nearest tier block by block, each
checked against the digest the catalog recorded (the first missing or damaged block and
everything after it are recomputed); then the new prompt, greedy decoding, the new blocks
written to every tier, and the turn recorded in the catalog before the reply is returned.

Every token with a KV entry is in a block (the last block may be partial), so an instance
that takes a conversation over holds exactly the cache the first one held: its replies are
the ones the first instance would have given.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch

from infra.catalog import sessions
from infra.catalog.db import Catalog
from infra.catalog.sessions import BlockRef
from infra.errors import CorruptCheckpoint
from infra.serving import kv_blocks
from infra.serving.kv_blocks import BLOCK_TOKENS, TieredBlocks


@dataclass(frozen=True, slots=True)
class Reply:
    tokens: list[int]
    turn: int
    ttft_s: float  # from the request to the first new token
    source: str  # "process", "blocks" (with the tier of the first), "recompute", or "new"
    reused_tokens: int  # context whose KV came from a process or a tier
    recomputed_tokens: int  # context whose KV had to be computed again
    refused_blocks: int  # blocks found but not matching their digest


@dataclass
class _Live:
    tokens: list[int]
    cache: Any
    blocks: list[BlockRef]


def _make_cache(keys: list[torch.Tensor], values: list[torch.Tensor], config: Any) -> Any:
    from transformers import DynamicCache

    pairs = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in zip(keys, values, strict=True)]
    if hasattr(DynamicCache, "from_legacy_cache"):  # transformers 4.x
        return DynamicCache.from_legacy_cache(tuple(pairs))
    return DynamicCache(ddp_cache_data=pairs, config=config)


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]


class Conversations:
    """One serving instance's side of every conversation of one model."""

    def __init__(
        self,
        model: Any,
        *,
        catalog: Catalog,
        blocks: TieredBlocks,
        model_name: str,
        instance: str,
        block_tokens: int = BLOCK_TOKENS,
        ttl_s: float = sessions.DEFAULT_TTL_S,
    ) -> None:
        self.model, self.cat, self.blocks = model.eval(), catalog, blocks
        self.model_name, self.instance = model_name, instance
        self.block_tokens, self.ttl_s = block_tokens, ttl_s
        self._live: dict[str, _Live] = {}
        # transformers 5 calls the cache `cache`; 4.x `past_key_values`
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def _forward(self, ids: list[int], cache: Any) -> tuple[torch.Tensor, Any]:
        out = self.model(torch.tensor([ids]), use_cache=True, **{self._cache_kw: cache})
        return out.logits, out["cache"] if "cache" in out else out["past_key_values"]

    @torch.no_grad()
    def turn(self, key: str, prompt: list[int], max_new_tokens: int) -> Reply:
        started = time.perf_counter()
        conv = sessions.load(self.cat, key)
        history = conv.tokens if conv is not None else []
        live, how = self._context(key, history, conv.blocks if conv is not None else [])
        feed = [
            *history[-1:],
            *prompt,
        ]  # the last reply token has no KV entry yet: it goes in with the prompt
        logits, cache = self._forward(feed, live.cache)
        nxt = int(logits[0, -1].argmax())
        ttft = time.perf_counter() - started
        reply = [nxt]
        while len(reply) < max_new_tokens:
            logits, cache = self._forward([nxt], cache)
            nxt = int(logits[0, -1].argmax())
            reply.append(nxt)
        live = _Live([*history, *prompt, *reply], cache, live.blocks)
        live.blocks = self._store_blocks(live)
        n = sessions.record_turn(
            self.cat, key, self.model_name, prompt=prompt, reply=reply, blocks=live.blocks,
            instance=self.instance, ttl_s=self.ttl_s,
        )  # fmt: skip
        self._live[key] = live
        return Reply(reply, n, ttft, *how)

    def forget(self, key: str) -> None:
        """Drop this process's copy of a conversation (as a dead instance would have)."""
        self._live.pop(key, None)

    def _context(
        self, key: str, history: list[int], refs: list[BlockRef]
    ) -> tuple[_Live, tuple[str, int, int, int]]:
        """A cache holding every history token but the last reply token, and how it was obtained."""
        held = self._live.get(key)
        if held is not None and held.tokens == history:
            return held, ("process", len(history) - 1, 0, 0)
        keys: list[list[torch.Tensor]] = []
        values: list[list[torch.Tensor]] = []
        good: list[BlockRef] = []
        first_tier, refused = "", 0
        for ref in refs:
            found = self.blocks.get(ref.name)
            if found is None:
                break
            try:
                k, v = kv_blocks.decode(found[0], ref.digest, ref.name)
            except CorruptCheckpoint:
                refused += 1
                break  # a damaged block is recomputed, never used; so is everything after it
            first_tier = first_tier or found[1]
            keys.append(k)
            values.append(v)
            good.append(ref)
        return self._rebuild(history, keys, values, good, first_tier, refused)

    def _rebuild(
        self,
        history: list[int],
        keys: list[list[torch.Tensor]],
        values: list[list[torch.Tensor]],
        good: list[BlockRef],
        tier: str,
        refused: int,
    ) -> tuple[_Live, tuple[str, int, int, int]]:
        covered = good[-1].end if good else 0
        cache = None
        if good:
            layers = len(keys[0])
            cache = _make_cache(
                [torch.cat([b[i] for b in keys], dim=1) for i in range(layers)],
                [torch.cat([b[i] for b in values], dim=1) for i in range(layers)],
                self.model.config,
            )
        todo = history[
            covered : max(covered, len(history) - 1)
        ]  # the last reply token is fed with the prompt
        if todo:
            cache = self._forward(todo, cache)[1]
        how = "new" if not history else f"blocks ({tier})" if good else "recompute"
        return _Live(history, cache, good), (how, covered, len(todo), refused)

    def _store_blocks(self, live: _Live) -> list[BlockRef]:
        """Write every block not yet written (and the partial last one again); the full list of refs."""
        with_kv = len(live.tokens) - 1  # the last reply token has no KV entry yet
        names = kv_blocks.block_names(live.tokens[:with_kv], self.block_tokens)
        kept = [r for r in live.blocks if r.end % self.block_tokens == 0 and r.end <= with_kv]
        layers = _layers(live.cache)
        refs = list(kept)
        for i in range(len(kept), len(names)):
            start, end = i * self.block_tokens, min((i + 1) * self.block_tokens, with_kv)
            data = kv_blocks.encode(
                [k[0, :, start:end] for k, _ in layers], [v[0, :, start:end] for _, v in layers]
            )
            self.blocks.put(names[i], data)
            refs.append(BlockRef(names[i], kv_blocks.digest(data), end))
        return refs
