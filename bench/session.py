"""Time to first token after fail-over: a conversation's KV cache loaded from the node-local tier (every block
checked against its recorded digest) against recomputing the whole context, in the same run.

    .venv/bin/python -m bench.session [--context 2000] [--repeat 5]

Writes ``session_ttft_ratio_vs_recompute`` and ``session_context_tokens`` to bench/results.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

from rewind.examples.chat_lm import build_model
from rewind.infra.catalog.db import Catalog
from rewind.infra.serving.conversation import Conversations
from rewind.infra.serving.kv_blocks import DiskBlocks, MemoryBlocks, TieredBlocks

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def _instance(model: object, cat: Catalog, blocks_dir: Path | None, name: str) -> Conversations:
    tiers = [MemoryBlocks(256 * MiB)] + ([DiskBlocks(blocks_dir, 1 << 30)] if blocks_dir else [])
    return Conversations(model, catalog=cat, blocks=TieredBlocks(tiers), model_name="chat", instance=name)


def measure(context: int, repeat: int, work: Path, *, layers: int, hidden: int) -> dict[str, object]:
    model = build_model(seed=0, layers=layers, hidden=hidden)
    cat = Catalog(f"sqlite:///{work / 'catalog.db'}")
    rng = random.Random(7)
    loaded, recomputed = [], []
    for i in range(repeat):
        key = f"bench-{i}"
        first = _instance(model, cat, work / "node", "a")
        first.turn(key, [rng.randrange(256) for _ in range(context)], max_new_tokens=8)
        prompt = [rng.randrange(256) for _ in range(16)]
        took_over = _instance(model, cat, work / "node", "b").turn(key, prompt, max_new_tokens=1)
        assert took_over.recomputed_tokens == 0, took_over
        loaded.append(took_over.ttft_s)
        # The same turn on an instance with no tier to load from: the whole context is recomputed.
        key2 = f"bench-recompute-{i}"
        first.turn(key2, [rng.randrange(256) for _ in range(context)], max_new_tokens=8)
        cold = _instance(model, cat, None, "c").turn(key2, prompt, max_new_tokens=1)
        assert cold.reused_tokens == 0, cold
        recomputed.append(cold.ttft_s)
    load_s, recompute_s = statistics.median(loaded), statistics.median(recomputed)
    return {
        "session_context_tokens": context + 8,
        "session_ttft_loaded_s": round(load_s, 4),
        "session_ttft_recompute_s": round(recompute_s, 4),
        "session_ttft_ratio_vs_recompute": round(load_s / recompute_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory(prefix="rewind-bench-session-") as tmp:
        res = measure(args.context, args.repeat, Path(tmp), layers=args.layers, hidden=args.hidden)
    res["session_model"] = f"Llama, {args.layers} layers, hidden {args.hidden}, random weights"
    print(
        f"time to first token after fail-over, {res['session_context_tokens']} tokens of context, "
        f"{res['session_model']} "
        f"(median of {args.repeat}):\n"
        f"  KV blocks from the node-local tier  {res['session_ttft_loaded_s']:.3f} s\n"
        f"  recompute the context              {res['session_ttft_recompute_s']:.3f} s\n"
        f"  ratio                              {res['session_ttft_ratio_vs_recompute']:.3f}x (target <= 0.25x)"
    )
    out = HERE / "results.json"
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged |= res
    out.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
