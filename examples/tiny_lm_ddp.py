"""tiny_lm on several ranks (DDP; gloo on CPU, NCCL on GPU), checkpointed shard by shard.

    python -m examples.tiny_lm_ddp --run NAME --steps N --checkpoint-every K --seed S --out DIR --nproc N

Same contract as ``examples.tiny_lm`` plus ``--nproc``: the command starts
``torchrun`` with N local ranks. It resumes from the newest verified checkpoint
whatever N it was saved with (DCP reshards; the data position is global, so no
sample is skipped or repeated when N changes). Each rank touches
``$REWIND_HEARTBEAT_DIR/rank-<r>`` every step when that is set.

Test seams (documented, off by default): ``--sample-log DIR`` writes the dataset
indices each rank consumed per step; ``REWIND_POISON_SAMPLE=i`` turns the loss
of any batch holding sample i into NaN (a bad data window);
``TINY_LM_DUMP_DIR`` makes rank 0 write the full model and optimizer state after
every save and restore; ``REWIND_HANG_AT_STEP=s`` (with ``REWIND_HANG_RANK=r``)
makes rank r stop stepping at step s.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn import functional as F

from examples.tiny_lm import parser, warmup_cosine
from examples.tiny_lm_model import CharDataset, TinyLM, corpus
from infra import config
from infra.checkpoint.sharded import ShardedCheckpointer
from infra.training.data import ResumableLoader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rng_state() -> dict[str, Any]:
    """Per-rank RNG as JSON-able values (sharded checkpoints keep tensors for the shared state)."""
    import random

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": bytes(torch.get_rng_state().numpy()),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8).clone())


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model/{k}": v.detach().clone().contiguous() for k, v in msd.items()}
    for name, st in osd.get("state", {}).items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                flat[f"optim/{name}/{k}"] = v.detach().clone().reshape(-1).contiguous()
    return flat


def _dump(model: torch.nn.Module, opt: torch.optim.Optimizer, name: str) -> None:
    where = os.environ.get("TINY_LM_DUMP_DIR")
    if where:
        full = _full_state(model, opt)  # collective
        if dist.get_rank() == 0:
            Path(where).mkdir(parents=True, exist_ok=True)
            save_file(full, str(Path(where) / f"{name}.safetensors"))


def train(args: Any) -> int:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = CharDataset(corpus(), args.block)
    model = torch.nn.parallel.DistributedDataParallel(
        TinyLM(data.vocab, args.block, dim=args.dim, layers=args.layers)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, max(1, args.steps // 10)))
    loader = ResumableLoader(data, args.batch_size, seed=args.seed, rank=rank, world=world)
    ck = ShardedCheckpointer(args.run, root=config.checkpoint_root())
    heartbeat = (
        Path(os.environ["REWIND_HEARTBEAT_DIR"]) / f"rank-{rank}"
        if os.environ.get("REWIND_HEARTBEAT_DIR")
        else None
    )
    poison = int(os.environ["REWIND_POISON_SAMPLE"]) if os.environ.get("REWIND_POISON_SAMPLE") else None

    # Optimizer state must exist to be loaded into: one zero-gradient step with lr 0 changes nothing.
    lrs = [g["lr"] for g in opt.param_groups]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    for st in opt.state.values():
        st["step"].zero_()

    def shared_state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "sched": sched.state_dict(), "data": loader.state_dict()}

    start = 0
    restored = ck.restore_latest(shared_state())
    for s in ck.skipped:
        print(f"rewind: skipped step {s.step}: {s.outcome}: {s.reason}", file=sys.stderr, flush=True)
    if restored is not None:
        start, tree, mine = restored
        set_state_dict(model, opt, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
        sched.load_state_dict(tree["sched"])
        loader.load_state_dict(tree["data"])
        _set_rng_state(mine["rng"])
        skip_to = int(os.environ.get("REWIND_SKIP_TO_SAMPLE", "0"))
        if skip_to > loader.consumed:
            loader.consumed = skip_to  # roll back past a bad data window
        _dump(model, opt, f"restored-{start}")
        if rank == 0:
            print(
                f"rewind: resumed run {args.run} at step {start} on {world} ranks (consumed {loader.consumed})",
                file=sys.stderr,
                flush=True,
            )

    batches = iter(loader)
    step = start
    hang_at = int(os.environ.get("REWIND_HANG_AT_STEP", "0"))
    for step in range(start + 1, args.steps + 1):
        if step == hang_at and rank == int(os.environ.get("REWIND_HANG_RANK", "0")):
            threading.Event().wait()  # test seam: this rank stops stepping; a supervisor must notice
        x, y = next(batches)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        if poison is not None and poison in loader.last_indices:
            loss = loss * float("nan")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if args.sample_log:
            with open(Path(args.sample_log) / f"rank-{rank}.log", "a") as f:
                f.write(json.dumps({"step": step, "world": world, "samples": loader.last_indices}) + "\n")
        if heartbeat is not None:
            tmp = heartbeat.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}))
            os.replace(tmp, heartbeat)
        if rank == 0:
            print(f"step={step} loss={loss.item()!r}", flush=True)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            ck.save(step, shared_state(), {"rng": _rng_state()}, metrics={"loss": loss.item()})
            _dump(model, opt, f"saved-{step}")
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().clone().contiguous() for k, v in model.module.state_dict().items()},
            str(args.out / "final.safetensors"),
        )
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    p.prog = "python -m examples.tiny_lm_ddp"
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (through torchrun)")
    p.add_argument(
        "--sample-log", type=Path, default=None, help="test seam: log each rank's sample indices per step"
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:  # torchrun hands our arguments over after a "--"
        argv = argv[1:]
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        return train(args)
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        "--max-restarts=0",
        "-m",
        "examples.tiny_lm_ddp",
        "--",
        *argv,
    ]
    os.execv(sys.executable, launcher)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
