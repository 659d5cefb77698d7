"""A small decoder-only transformer language model, trained on CPU under Rewind.

    python -m rewind.examples.tiny_lm --run NAME --steps N --checkpoint-every K --seed S --out DIR

Resumes by itself from the newest verified checkpoint of run NAME, prints
``step=<i> loss=<repr>`` per step and writes ``DIR/final.safetensors`` at the end.
The catalog and checkpoint root come from ``REWIND_CATALOG_URL`` /
``REWIND_CHECKPOINT_ROOT`` (embedded defaults under ``REWIND_HOME``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from rewind.examples.tiny_lm_model import CharDataset, TinyLM, corpus
from rewind.infra.checkpoint.engine import SaveMode
from rewind.infra.errors import RewindError
from rewind.infra.training.data import ResumableLoader
from rewind.infra.training.session import TrainingSession


def warmup_cosine(total: int, warmup: int):  # type: ignore[no-untyped-def]
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def command(
    run: str,
    out: Path,
    *,
    steps: int = 60,
    every: int = 10,
    seed: int = 0,
    extra: list[str] | None = None,
    module: str = "rewind.examples.tiny_lm",
) -> list[str]:
    """The command line that runs this example, or ``rewind.examples.tiny_lm_ddp`` (same contract)."""
    return [
        sys.executable,
        "-m",
        module,
        "--run",
        run,
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(every),
        "--seed",
        str(seed),
        "--out",
        str(out),
        *(extra or []),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rewind.examples.tiny_lm", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="run name in the catalog; resumes if it has checkpoints")
    p.add_argument("--steps", type=int, required=True, help="total optimizer steps")
    p.add_argument("--checkpoint-every", type=int, required=True, help="save every K steps (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="directory for final.safetensors")
    p.add_argument(
        "--stop-after", type=int, default=None, help="exit cleanly after this step (an interruption)"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block", type=int, default=32, help="context length")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--async-save", action="store_true", help="stage to memory, persist in the background")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed for reproducibility)")
    p.add_argument(
        "--step-time-s", type=float, default=0.0, help="pad each step to this long (a bigger model's pace)"
    )
    p.add_argument(
        "--loss-log", type=Path, default=None, help="append one JSON line per step (step, loss, time, launch)"
    )
    p.add_argument(
        "--poison-position",
        type=int,
        default=None,
        help="a test seam: the step whose batch holds this sample position (global, from the start) "
        "gets a NaN loss (a bad batch; skipped after recovery, so it is not drawn again)",
    )
    return p


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    device = _device()
    data = CharDataset(corpus(), args.block)
    model = TinyLM(data.vocab, args.block, dim=args.dim, layers=args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, max(1, args.steps // 10)))
    loader = ResumableLoader(data, args.batch_size, seed=args.seed)
    extras: dict = {"config": {"steps": args.steps, "batch_size": args.batch_size, "dim": args.dim}}

    mode = SaveMode.ASYNC if args.async_save else SaveMode.SYNC
    session = TrainingSession(
        args.run, model=model, optimizer=opt, states={"lr_scheduler": sched, "extras": extras}, loader=loader,
        checkpoint_every=args.checkpoint_every, mode=mode,
    )  # fmt: skip
    with session as s:
        for skip in s.skipped:
            print(f"rewind: skipped step {skip.step}: {skip.reason}", file=sys.stderr)
        if s.start_step:
            print(
                f"rewind: resumed run {args.run} at step {s.start_step} from {s.restored_from}",
                file=sys.stderr,
            )
        step = _loop(args, s, model, opt, sched, loader, device)
        if step is None:
            return 0  # --stop-after: an interruption, no final weights
        if args.checkpoint_every and step % args.checkpoint_every != 0:
            s.save(step)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".final.safetensors.tmp-{os.getpid()}"
    save_file({k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}, str(tmp))
    os.replace(tmp, args.out / "final.safetensors")
    return 0


def _device() -> torch.device:
    """The GPU when there is one (deterministic kernels, so a resume is bit-exact there too), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch.device("cuda", torch.cuda.current_device())


def _loop(
    args: argparse.Namespace,
    s: TrainingSession,
    model: Any,
    opt: Any,
    sched: Any,
    loader: Any,
    device: torch.device,
) -> int | None:
    """The training steps; the last step run, or None when ``--stop-after`` ended them early."""
    model.train()
    batches = iter(loader)
    step = s.start_step
    log = LossLog(args.loss_log)
    log.write({"event": "resumed", "from_step": s.start_step})
    for step in s.steps(args.steps):
        began = time.monotonic()
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        p = args.poison_position
        if p is not None and loader.total - args.batch_size <= p < loader.total:
            loss = loss * float("nan")  # a bad batch: the session stops the job at this step
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()
        print(f"step={step} loss={value!r}", flush=True)
        log.write({"step": step, "loss": value})
        if (pad := args.step_time_s - (time.monotonic() - began)) > 0:
            time.sleep(pad)  # the pace of a bigger model, not synchronisation
        s.report(step, value)
        if args.stop_after is not None and step >= args.stop_after:
            return None
    return step


class LossLog:
    """One JSON line per event, flushed as written (a drill reads the curve after a crash)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = {**record, "t": time.time(), "launch": os.environ.get("REWIND_LAUNCH_ID")}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("REWIND_LOG_LEVEL", "WARNING"), format="%(name)s: %(message)s")
    args = parse_args(argv)
    try:
        return train(args)
    except RewindError as exc:
        print(f"tiny_lm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
