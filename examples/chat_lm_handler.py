"""TorchServe handler for conversations with ``chat_lm``: a session's turns continue on any instance.

Packed by ``rewind serving deploy`` with ``chat_lm.py``. A request is JSON::

    {"session_id": "...", "text": "the new user turn", "max_new_tokens": 32}

(or ``"tokens": [...]`` instead of ``text``; ``"turn": N``, the turn the client means, makes a
retried request return the recorded reply instead of answering twice). The reply carries the generated text and tokens,
the turn number, the time to the first token and where the conversation's KV cache came from
(this process, the node-local block tier, or recomputed). The history and the block digests
live in the catalog (``REWIND_CATALOG_URL``); blocks in ``REWIND_KV_DIR`` (default
``$REWIND_SERVING_HOME/kv-blocks``), shared by the instances of one node. Blocks are named by
the digest of the weights file this instance loaded (and of the model's config): instances of
one version share them, a restarted one finds its own, and a version with other weights never
uses them (its conversations' context is recomputed).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from chat_lm import build_model, decode, encode
from safetensors.torch import load

from rewind.infra import config
from rewind.infra.catalog.db import Catalog
from rewind.infra.format.digest import hash_bytes
from rewind.infra.serving.conversation import Conversations
from rewind.infra.serving.kv_blocks import DiskBlocks, MemoryBlocks, TieredBlocks

MiB = 1 << 20
MAX_NEW_TOKENS = 256


class ChatHandler:
    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties["model_dir"]
        self.version = str(context.manifest["model"].get("modelVersion", ""))
        # One read: the bytes hashed are the bytes loaded. Blocks are named by them (and by the model's
        # config), so a version with other weights never takes another's blocks, and one restarted keeps its own.
        raw = Path(model_dir, "weights.safetensors").read_bytes()
        self.weights = hash_bytes(raw).xxh3
        weights = load(raw)
        del raw
        layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
        hidden = int(weights["model.embed_tokens.weight"].shape[1])
        model = build_model(layers=layers, hidden=hidden)
        model.load_state_dict(weights)
        kv_dir = Path(os.environ.get("REWIND_KV_DIR") or config.serving_home() / "kv-blocks")
        tiers = TieredBlocks([MemoryBlocks(int(os.environ.get("REWIND_KV_MEMORY_MIB", "512")) * MiB),
                              DiskBlocks(kv_dir, int(os.environ.get("REWIND_KV_DISK_MIB", "4096")) * MiB)])  # fmt: skip
        name = str(context.manifest["model"].get("modelName", "chat"))
        architecture = hash_bytes(model.config.to_json_string(use_diff=False).encode()).xxh3
        self.engine = Conversations(
            model,
            catalog=Catalog(),
            blocks=tiers,
            model_name=name,
            instance=f"{socket.gethostname()}:{os.getpid()}",
            model_id=f"{name}:weights-xxh3-{self.weights}:config-xxh3-{architecture}",
        )
        self.initialized = True

    def _turn(self, body: dict[str, Any]) -> dict[str, Any]:
        key = str(body["session_id"])
        prompt = [int(t) for t in body["tokens"]] if "tokens" in body else encode(str(body["text"]))
        limit = min(int(body.get("max_new_tokens", 32)), MAX_NEW_TOKENS)
        number = int(body["turn"]) if "turn" in body else None  # lets a retried request get its own answer
        reply = self.engine.turn(key, prompt, max_new_tokens=limit, number=number)
        return {
            "session_id": key, "turn": reply.turn, "text": decode(reply.tokens), "tokens": reply.tokens,
            "ttft_ms": round(reply.ttft_s * 1000, 2), "source": reply.source, "reused_tokens": reply.reused_tokens,
            "recomputed_tokens": reply.recomputed_tokens, "refused_blocks": reply.refused_blocks,
            "version": self.version, "instance": self.engine.instance,
        }  # fmt: skip

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        out = []
        for row in data:
            raw = row.get("data") or row.get("body") or b"{}"
            body = raw if isinstance(raw, dict) else json.loads(raw)
            out.append(json.dumps(self._turn(body)))
        return out
