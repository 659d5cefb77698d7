"""A ``transformers.Trainer`` job protected by Rewind: three lines added to an ordinary Trainer script.

    python -m rewind.examples.hf_trainer --run NAME --steps 60 --save-steps 10 --out DIR

A small Llama built from a config (random initialisation: nothing is downloaded), trained by Trainer on
the tiny_lm corpus one character per token, with dropout (so the RNG state matters). Kill it at any
moment and start it again: it resumes from its newest checkpoint that proves itself, and ends with the
weights of a run never interrupted, bit for bit. Writes ``DIR/final.safetensors``. Needs the ``hf``
extra (``pip install 'rewind[hf]'``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rewind.examples.tiny_lm_model import CharDataset, corpus


class Chars(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The corpus as Trainer's causal-LM examples (the library shifts the labels itself)."""

    def __init__(self, block: int) -> None:
        self.chars = CharDataset(corpus(), block)

    def __len__(self) -> int:
        return len(self.chars)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.chars[i]
        return {"input_ids": x, "labels": x}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m rewind.examples.hf_trainer", description=__doc__.splitlines()[0]
    )
    p.add_argument("--run", required=True, help="run name in the catalog; resumes if it has checkpoints")
    p.add_argument("--steps", type=int, required=True, help="Trainer's max_steps")
    p.add_argument("--save-steps", type=int, required=True, help="Trainer's save_steps")
    p.add_argument("--out", type=Path, required=True, help="directory for final.safetensors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.0, help="pad each step to this long")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed

    from rewind.integrations.transformers import RewindCallback

    args = parse_args(argv)
    torch.set_num_threads(1)
    set_seed(args.seed)
    data = Chars(block=32)
    config = LlamaConfig(vocab_size=data.chars.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                         attention_dropout=0.1)  # fmt: skip
    model = LlamaForCausalLM(config)
    targs = TrainingArguments(
        output_dir=str(args.out / "trainer"), max_steps=args.steps, save_steps=args.save_steps,
        save_strategy="steps", per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=5,
        logging_steps=1, seed=args.seed, report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True,
    )  # fmt: skip
    rewind = RewindCallback(args.run)  # 1: the callback, with the run's name
    callbacks = [rewind] + ([_Pace(args.step_time_s)] if args.step_time_s > 0 else [])
    # 2: handed to Trainer
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
    resume = rewind.resume_point()  # 3: the newest checkpoint that proves itself (None: a fresh run)
    if resume is not None:
        print(f"rewind: resumed run {args.run} at step {rewind.start_step}", file=sys.stderr, flush=True)
    trainer.train(resume_from_checkpoint=resume)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.out / "final.safetensors"))
    return 0


def _Pace(seconds: float) -> object:
    """A callback that pads each step to ``seconds`` (a bigger model's pace, for drills by hand)."""
    import time

    from transformers import TrainerCallback

    class Pace(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: object, **kw: object) -> None:
            self.began = time.monotonic()

        def on_step_end(self, *a: object, **kw: object) -> None:
            time.sleep(max(0.0, seconds - (time.monotonic() - self.began)))

    return Pace()


if __name__ == "__main__":
    sys.exit(main())
