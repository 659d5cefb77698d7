"""Conversations that outlive the instance serving them: history in the catalog, KV cache in tiers.

A turn: the conversation so far comes from the catalog (``rewind.infra.catalog.sessions``); its KV
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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from rewind.infra.catalog import sessions
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.sessions import BlockRef
from rewind.infra.errors import MalformedFile, Refused
from rewind.infra.serving import kv_blocks
from rewind.infra.serving.kv_blocks import BLOCK_TOKENS, TieredBlocks


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
        model_id: str | None = None,
        block_tokens: int = BLOCK_TOKENS,
        ttl_s: float = sessions.DEFAULT_TTL_S,
        keep_live: int = 64,
    ) -> None:
        """``model_id`` names the weights (e.g. the version's manifest digest): blocks are only shared by
        instances serving the same one. ``keep_live``: conversations whose cache this process keeps."""
        self.model, self.cat, self.blocks = model.eval(), catalog, blocks
        self.model_name, self.instance = model_name, instance
        self.model_id = model_id or model_name
        self.block_tokens, self.ttl_s, self.keep_live = block_tokens, ttl_s, keep_live
        self.device = next(model.parameters()).device
        self._live: OrderedDict[str, _Live] = OrderedDict()
        # transformers 5 calls the cache `cache`; 4.x `past_key_values`
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def _forward(self, ids: list[int], cache: Any) -> tuple[torch.Tensor, Any]:
        out = self.model(torch.tensor([ids], device=self.device), use_cache=True, **{self._cache_kw: cache})
        return out.logits, out["cache"] if "cache" in out else out["past_key_values"]

    @torch.no_grad()
    def turn(self, key: str, prompt: list[int], max_new_tokens: int, *, number: int | None = None) -> Reply:
        """Answer the next turn of ``key``; with ``number`` (the turn the client means), a retried request for
        a turn already answered gets the recorded reply, not a second turn."""
        started = time.perf_counter()
        conv = sessions.load(self.cat, key)
        if conv is not None and conv.model != self.model_name:
            raise Refused(f"session {key} is a conversation with {conv.model}, not {self.model_name}")
        if number is not None and (done := self._answered(key, conv, prompt, number)) is not None:
            return done
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
            history_len=len(history), instance=self.instance, ttl_s=self.ttl_s, expect=number,
        )  # fmt: skip
        self._live[key] = live
        self._live.move_to_end(key)
        while len(self._live) > self.keep_live:
            self._live.popitem(last=False)
        return Reply(reply, n, ttft, *how)

    def _answered(
        self, key: str, conv: sessions.Conversation | None, prompt: list[int], number: int
    ) -> Reply | None:
        turns = conv.turns if conv is not None else 0
        if number == turns + 1:
            return None
        recorded = sessions.recorded_turn(self.cat, key, number) if number <= turns else None
        if recorded is None or recorded[0] != prompt:
            raise Refused(f"session {key}: turn {number} asked, but the conversation is at turn {turns}")
        return Reply(recorded[1], number, 0.0, "recorded", 0, 0, 0)

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
        for ref, name, end in zip(refs, *self._expected(history), strict=False):
            if (ref.name, ref.end) != (name, end):
                break  # not a block of this conversation's tokens under these weights: recomputed
            found = self.blocks.get(ref.name, ref.digest)
            refused += found.refused
            if found.data is None:
                break  # missing, or no copy matches its digest: recomputed, never used, with all after it
            try:
                k, v = kv_blocks.decode(found.data)
            except MalformedFile:
                refused += 1
                break
            first_tier = first_tier or found.tier
            keys.append(k)
            values.append(v)
            good.append(ref)
        return self._rebuild(history, keys, values, good, first_tier, refused)

    def _expected(self, history: list[int]) -> tuple[list[str], list[int]]:
        """The names and ends of the blocks that cover ``history`` (all but its last token have KV)."""
        with_kv = max(0, len(history) - 1)
        names = kv_blocks.block_names(history[:with_kv], self.model_id, self.block_tokens)
        return names, [min((i + 1) * self.block_tokens, with_kv) for i in range(len(names))]

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
                [torch.cat([b[i] for b in keys], dim=1).to(self.device) for i in range(layers)],
                [torch.cat([b[i] for b in values], dim=1).to(self.device) for i in range(layers)],
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
        names, ends = self._expected(live.tokens)
        kept = [r for r in live.blocks if r.end % self.block_tokens == 0][: len(names)]
        layers = _layers(live.cache)
        refs = list(kept)
        for i in range(len(kept), len(names)):
            start, end = i * self.block_tokens, ends[i]
            data = kv_blocks.encode(
                [k[0, :, start:end] for k, _ in layers], [v[0, :, start:end] for _, v in layers]
            )
            refs.append(BlockRef(names[i], self.blocks.put(names[i], data), end))
        return refs
