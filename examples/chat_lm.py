"""A small causal language model for conversations, built from a config (no download), and a byte tokenizer.

Random weights from a fixed seed: the replies are nonsense, but deterministic, which is what the
serving tests need (a reply after fail-over must equal the reply without one). Any Hugging Face
causal LM can take its place.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 259  # bytes, and three spare ids


def build_model(seed: int = 0, *, layers: int = 4, hidden: int = 256) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    return LlamaForCausalLM(config).eval()


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    """Save the model (random weights from ``--seed``) as step 1 of ``--run``, ready to verify and deploy."""
    import argparse

    from rewind.infra.checkpoint.engine import Checkpointer

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--run", default="chat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args(argv)
    saver = Checkpointer(
        args.run, states={"model": build_model(args.seed, layers=args.layers, hidden=args.hidden)}
    )
    try:
        saver.save(1)
    finally:
        saver.close()
    print(f"saved {args.run} step 1; next: rewind ckpt verify --deep {args.run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
