"""tiny_lm on several ranks (DDP; gloo on CPU, NCCL on GPU), under Rewind's training session.

    python -m rewind.examples.tiny_lm_ddp --run NAME --steps N --checkpoint-every K --seed S --out DIR --nproc N

Same contract as ``rewind.examples.tiny_lm`` plus ``--nproc``: started by hand, the command
starts ``torchrun`` with N local ranks; started by Rewind's supervisor (from a job
spec), it already runs under torchrun. Everything Rewind does happens through
``TrainingSession``: it resumes from the newest verified checkpoint whatever N it
was saved with (DCP reshards; the data position is global, so no sample is skipped
or repeated when N changes), reports progress to the supervisor, stops on a NaN,
skips a data window the supervisor hands it, and the learning rate follows the
handoff's scale. On a GPU each rank uses its own device (``LOCAL_RANK``).

Test seams (documented, off by default): ``--sample-log DIR`` writes the dataset
indices each rank consumed per step; ``TINY_LM_DUMP_DIR`` makes rank 0 write the
full model and optimizer state after every save and restore.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.nn import functional as F

from rewind.examples.tiny_lm import LossLog, parser, warmup_cosine
from rewind.examples.tiny_lm_model import CharDataset, TinyLM, corpus
from rewind.infra.checkpoint.engine import SaveMode
from rewind.infra.training.data import ResumableLoader
from rewind.infra.training.session import TrainingSession


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device() -> torch.device:
    """This rank's device: its own GPU (LOCAL_RANK) when there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def full_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, *, gather: bool = True
) -> dict[str, torch.Tensor]:
    """The model's and optimizer's state as plain tensors: gathered whole on rank 0 (``gather``), or what
    this rank holds (a pipeline stage)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if gather else None
    msd, osd = get_state_dict(model, opt, options=options)
    flat = {f"model/{k}": v.detach().clone().contiguous() for k, v in msd.items()}
    for name, st in osd.get("state", {}).items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                flat[f"optim/{name}/{k}"] = v.detach().clone().reshape(-1).contiguous()
    return flat


def dump_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, name: str, *, per_rank: bool = False
) -> None:
    """Test seam (``TINY_LM_DUMP_DIR``): rank 0 writes the whole state, or (``per_rank``) every rank its own
    as ``NAME-rankR``."""
    where = os.environ.get("TINY_LM_DUMP_DIR")
    if where:
        full = full_state(model, opt, gather=not per_rank)  # collective when gathering
        if per_rank or dist.get_rank() == 0:
            Path(where).mkdir(parents=True, exist_ok=True)
            file = f"{name}-rank{dist.get_rank()}" if per_rank else name
            save_file(full, str(Path(where) / f"{file}.safetensors"))


def train(args: Any) -> int:
    device = rank_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    _train(args, device)
    gc.collect()  # the DDP model and its reducer freed while the group still exists
    dist.barrier()  # every rank done before any tears the group down (gloo aborts on a vanished peer)
    dist.destroy_process_group()
    return 0


def _train(args: Any, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = CharDataset(corpus(), args.block)
    model = TinyLM(data.vocab, args.block, dim=args.dim, layers=args.layers).to(device)
    model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, max(1, args.steps // 10)))
    loader = ResumableLoader(data, args.batch_size, seed=args.seed, rank=rank, world=world)
    session = TrainingSession(
        args.run, model=model, optimizer=opt, states={"sched": sched}, loader=loader,
        checkpoint_every=args.checkpoint_every, mode=SaveMode.ASYNC if args.async_save else SaveMode.SYNC,
    )  # fmt: skip
    with session as s:
        # The full-size rate, scaled for the ranks this launch has (1.0 at full size): set every time,
        # since a checkpoint written by a smaller launch carries that launch's scaled rate.
        sched.base_lrs = [args.lr * s.handoff.lr_scale for _ in sched.base_lrs]
        if s.start_step:
            for g, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
                g["lr"] = base * factor(sched.last_epoch)
        s.note(lr=sched.base_lrs[0], global_batch=args.batch_size * world, world_size=world)
        print_skipped(s)
        if s.start_step:
            dump_state(model, opt, f"restored-{s.start_step}")
            if rank == 0:
                print(
                    f"rewind: resumed run {args.run} at step {s.start_step} on {world} ranks "
                    f"(consumed {loader.consumed})",
                    file=sys.stderr,
                    flush=True,
                )
        _loop(args, s, model, opt, sched, loader, device, rank, world)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().to("cpu").clone().contiguous() for k, v in model.module.state_dict().items()}
        save_file(weights, str(args.out / "final.safetensors"))


def _loop(args: Any, s: TrainingSession, model: Any, opt: Any, sched: Any, loader: Any, device: torch.device,
          rank: int, world: int) -> None:  # fmt: skip
    batches = iter(loader)
    log = LossLog(args.loss_log if rank == 0 else None)  # the curve a drill reads: rank 0's
    log.write({"event": "resumed", "from_step": s.start_step})
    for step in s.steps(args.steps):
        began = time.monotonic()
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if args.sample_log:
            with open(Path(args.sample_log) / f"rank-{rank}.log", "a") as f:
                f.write(json.dumps({"step": step, "world": world, "samples": loader.last_indices}) + "\n")
        value = loss.item()
        if rank == 0:
            print(f"step={step} loss={value!r}", flush=True)
        log.write({"step": step, "loss": value})
        if (pad := args.step_time_s - (time.monotonic() - began)) > 0:
            time.sleep(pad)  # the pace of a bigger model, not synchronisation
        s.report(step, value)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            dump_state(model, opt, f"saved-{step}")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    p.prog = "python -m rewind.examples.tiny_lm_ddp"
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (through torchrun)")
    p.add_argument(
        "--sample-log", type=Path, default=None, help="test seam: log each rank's sample indices per step"
    )
    argv = own_argv(argv)
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        return train(args)
    return torchrun_exec("rewind.examples.tiny_lm_ddp", args.nproc, argv)


def own_argv(argv: list[str] | None) -> list[str]:
    """This process's arguments (torchrun hands them over after a "--")."""
    argv = sys.argv[1:] if argv is None else argv
    return argv[1:] if argv[:1] == ["--"] else argv


def torchrun_exec(module: str, nproc: int, argv: list[str]) -> int:
    """Become torchrun starting ``nproc`` local ranks of ``module`` with ``argv`` (started by hand)."""
    launcher = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", "--max-restarts=0", "-m", module, "--", *argv,
    ]  # fmt: skip
    os.execv(sys.executable, launcher)
    return 0  # not reached


def print_skipped(session: TrainingSession) -> None:
    """Say on stderr which steps the supervisor had the job skip (poisoned batches)."""
    for skip in session.skipped:
        print(f"rewind: skipped step {skip.step}: {skip.outcome}: {skip.reason}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
