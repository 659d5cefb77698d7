"""A tiny transformer trained tensor-parallel x data-parallel (or in pipeline stages), under Rewind's session.

    python -m rewind.examples.tp_lm --run NAME --steps N --checkpoint-every K --tp T --nproc N

The device mesh is (pp, dp, tp): attention and MLP are split over ``tp`` with DTensor's tensor parallelism
(query/key/value and the MLP's first layer by columns, the output projections by rows), and the whole
model is sharded over ``dp`` with FSDP2 (``fully_shard``); gloo on the CPU, NCCL on GPUs. The layout
is the one the launch was handed (``REWIND_LAYOUT``: the job spec's first, then what the rebuild planned
for the devices left), else ``--tp`` when started by hand. The session records the layout and the model's
shape with every checkpoint; a relaunch on another layout restores parameters and optimizer state
resharded through DCP. Each data-parallel group reads its share of a global order (``ResumableLoader``
split by DP rank, the same batch for every TP peer), so no sample is skipped or repeated when DP changes.
With PP > 1 (PP alone here: ``--tp 1 --pp 2``) each rank keeps one stage's layers under the full model's
names and steps through ``torch.distributed.pipelining`` (GPipe, 2 micro-batches); the checkpoint of
the stages loads into one process (PP 1) and back.

Test seam (off by default): ``TINY_LM_DUMP_DIR`` makes rank 0 write the full (gathered) model and
optimizer state after every save and restore (with pipeline stages, each rank its stage's, ``NAME-rankR``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4 and 2.5 (pyproject's floor): FSDP2 lived here
    from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

from rewind.examples.tiny_lm import LossLog
from rewind.examples.tiny_lm_ddp import (
    dump_state,
    full_state,
    own_argv,
    print_skipped,
    rank_device,
    torchrun_exec,
)
from rewind.examples.tiny_lm_model import CharDataset, corpus
from rewind.infra.health.layout import Layout, ModelShape
from rewind.infra.training.data import ResumableLoader
from rewind.infra.training.handoff import handed_layout
from rewind.infra.training.session import TrainingSession

TP_PLAN = {
    "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
}  # fmt: skip


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds heads / tp of them
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = (
            nn.LayerNorm(dim),
            Attention(dim, heads),
            nn.LayerNorm(dim),
            MLP(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TPLM(nn.Module):
    def __init__(self, vocab: int, block: int, *, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, block, dim) * 0.02)
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.ln: nn.Module | None = nn.LayerNorm(dim)
        self.head: nn.Module | None = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:  # the first stage (or the whole model): token ids in
            x = self.tok(x) + self.pos[:, : x.shape[1]]
        for blk in self.blocks.values():
            x = blk(x)
        return self.head(self.ln(x)) if self.head is not None and self.ln is not None else x

    def keep_stage(self, stage: int, stages: int) -> None:
        """Drop what another pipeline stage holds; the names of what is left are the full model's, so a
        checkpoint of the stages loads into one process and back."""
        per = len(self.blocks) // stages
        for i in list(self.blocks):
            if not stage * per <= int(i) < (stage + 1) * per:
                del self.blocks[i]
        if stage > 0:
            self.tok, self.pos = None, None  # type: ignore[assignment]
        if stage < stages - 1:
            self.ln, self.head = None, None


def layout_for(args: argparse.Namespace, world: int) -> Layout:
    """What the launch was handed, else ``--tp`` (DP the rest) for a job started by hand."""
    given = handed_layout()
    if given is None:
        if world % (args.tp * args.pp):
            raise SystemExit(f"--tp {args.tp} x --pp {args.pp} does not divide the {world} ranks")
        given = Layout(tp=args.tp, pp=args.pp, dp=world // (args.tp * args.pp))
    if given.world_size != world or (given.pp > 1 and given.world_size != given.pp):
        raise SystemExit(
            f"this example runs TP x DP, or PP alone, on its {world} ranks; it was handed {given}"
        )
    if given.pp > 1 and args.layers % given.pp:
        raise SystemExit(f"PP {given.pp} does not divide the {args.layers} layers")
    return given


def build(
    args: argparse.Namespace, layout: Layout, device: torch.device, vocab: int
) -> tuple[nn.Module, DeviceMesh]:
    torch.manual_seed(args.seed)  # the same full model on every rank, before it is split
    model = TPLM(vocab, args.block, dim=args.dim, heads=args.heads, layers=args.layers).to(device)
    mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    if layout.pp > 1:
        model.keep_stage(dist.get_rank(), layout.pp)
    if layout.tp > 1:
        for blk in model.blocks.values():
            parallelize_module(blk, mesh["tp"], TP_PLAN)
    if layout.dp > 1:
        for blk in model.blocks.values():
            fully_shard(blk, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, mesh


class Pipeline:
    """One training step through pipeline stages (GPipe, 2 micro-batches): the first stage feeds the
    tokens, the last computes the loss, every stage learns it (rank 0 reports it)."""

    def __init__(self, model: nn.Module, layout: Layout, device: torch.device) -> None:
        self.stage, self.last = dist.get_rank(), layout.pp - 1
        stage = PipelineStage(model, self.stage, layout.pp, device)
        self.schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=_loss)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if self.stage == 0:
            self.schedule.step(x)
        elif self.stage == self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(loss, src=self.last)
        return loss


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(args: argparse.Namespace) -> int:
    device = rank_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(args.threads)
    layout = layout_for(args, dist.get_world_size())
    data = CharDataset(corpus(), args.block)
    model, mesh = build(args, layout, device, data.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loader = ResumableLoader(
        data, args.batch_size, seed=args.seed, rank=mesh["dp"].get_local_rank(), world=layout.dp
    )
    shape = ModelShape(heads=args.heads, hidden=args.dim, layers=args.layers)
    session = TrainingSession(
        args.run, model=model, optimizer=opt, loader=loader, checkpoint_every=args.checkpoint_every,
        layout=layout, model_shape=shape,
    )  # fmt: skip
    with session as s:
        for g in opt.param_groups:  # the full-size rate, scaled for this launch's DP (1.0 at full size)
            g["lr"] = args.lr * s.handoff.lr_scale
        s.note(lr=args.lr * s.handoff.lr_scale, global_batch=loader.global_batch, layout=layout.as_dict())
        print_skipped(s)
        if s.start_step:
            dump_state(model, opt, f"restored-{s.start_step}", per_rank=layout.pp > 1)
            if dist.get_rank() == 0:
                print(
                    f"rewind: resumed run {args.run} at step {s.start_step} as {layout}",
                    file=sys.stderr,
                    flush=True,
                )
        _loop(args, s, model, opt, loader, device, Pipeline(model, layout, device) if layout.pp > 1 else None)
    if args.out is not None:
        weights = {k: v for k, v in full_state(model, opt).items() if k.startswith("model/")}  # collective
        if dist.get_rank() == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(args.out / "final.safetensors"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _loop(args: argparse.Namespace, s: TrainingSession, model: nn.Module, opt: Any, loader: Any,
          device: torch.device, pipe: Pipeline | None) -> None:  # fmt: skip
    batches = iter(loader)
    log = LossLog(args.loss_log if dist.get_rank() == 0 else None)  # the curve a drill reads: rank 0's
    log.write({"event": "resumed", "from_step": s.start_step})
    for step in s.steps(args.steps):
        began = time.monotonic()
        x, y = (t.to(device) for t in next(batches))
        opt.zero_grad(set_to_none=True)
        if pipe is not None:
            loss = pipe.step(x, y)
        else:
            loss = _loss(model(x), y)
            loss.backward()
        opt.step()
        value = loss.item()
        if dist.get_rank() == 0:
            print(f"step={step} loss={value!r}", flush=True)
        log.write({"step": step, "loss": value})
        if (pad := args.step_time_s - (time.monotonic() - began)) > 0:
            time.sleep(pad)  # the pace of a bigger model, not synchronisation
        s.report(step, value)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            dump_state(model, opt, f"saved-{step}", per_rank=pipe is not None)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rewind.examples.tp_lm", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="run name in the catalog; resumes if it has checkpoints")
    p.add_argument("--steps", type=int, required=True, help="total optimizer steps")
    p.add_argument("--checkpoint-every", type=int, required=True, help="save every K steps (0: never)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree when no layout was handed")
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline stages when no layout was handed (with --tp 1)"
    )
    p.add_argument("--nproc", type=int, default=4, help="ranks to start through torchrun (started by hand)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="samples per data-parallel rank per step")
    p.add_argument("--block", type=int, default=16, help="context length")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--step-time-s", type=float, default=0.0, help="pad each step to this long")
    p.add_argument("--out", type=Path, default=None, help="directory for the final (gathered) weights")
    p.add_argument("--loss-log", type=Path, default=None, help="rank 0 appends one JSON line per step")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = own_argv(argv)
    args = parser().parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        return train(args)
    return torchrun_exec("rewind.examples.tp_lm", args.nproc, argv)


if __name__ == "__main__":
    sys.exit(main())
