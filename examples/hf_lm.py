"""A Hugging Face ``transformers`` causal LM trained under Rewind's session API.

    python -m rewind.examples.hf_lm --run NAME --steps 60 --checkpoint-every 10 --seed 0 --out DIR

A small Llama built from a config (random initialisation: nothing is downloaded),
trained on the tiny_lm corpus one character per token, with AdamW and the
library's own linear warm-up schedule. Same contract as ``rewind.examples.tiny_lm``: it
resumes by itself, bit-exact, prints ``step=<i> loss=<repr>`` and writes
``DIR/final.safetensors``. Needs the ``hf`` extra (``pip install -e '.[hf]'``).
"""

from __future__ import annotations

import logging
import os
import random
import sys
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from rewind.examples.tiny_lm import parser
from rewind.examples.tiny_lm_model import CharDataset, corpus
from rewind.infra.errors import RewindError
from rewind.infra.training.data import ResumableLoader
from rewind.infra.training.session import TrainingSession


def build(vocab: int, args: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.dim, intermediate_size=4 * args.dim, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.block,
        attention_dropout=0.1, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def train(args: Any) -> int:
    from transformers import get_linear_schedule_with_warmup

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    data = CharDataset(corpus(), args.block)
    model = build(data.vocab, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, max(1, args.steps // 10), args.steps)
    loader = ResumableLoader(data, args.batch_size, seed=args.seed)
    with TrainingSession(args.run, model=model, optimizer=opt, states={"lr_scheduler": sched}, loader=loader,
                         checkpoint_every=args.checkpoint_every) as s:  # fmt: skip
        if s.start_step:
            print(
                f"rewind: resumed run {args.run} at step {s.start_step} from {s.restored_from}",
                file=sys.stderr,
            )
        model.train()
        batches = iter(loader)
        for step in s.steps(args.steps):
            x, _ = next(batches)
            loss = model(input_ids=x, labels=x).loss  # the library shifts the labels itself
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            print(f"step={step} loss={loss.item()!r}", flush=True)
            s.report(step, loss.item())
            if args.stop_after is not None and step >= args.stop_after:
                return 0
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
        str(args.out / "final.safetensors"),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("REWIND_LOG_LEVEL", "WARNING"), format="%(name)s: %(message)s")
    p = parser()
    p.prog = "python -m rewind.examples.hf_lm"
    try:
        return train(p.parse_args(argv))
    except RewindError as exc:
        print(f"hf_lm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
