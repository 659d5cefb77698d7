"""The training process of the GC tests: a fine-tune with a frozen backbone, saved in the chunked format.

``python -m tests.gc_worker RUN ROOT EXPECTED --saves N`` resumes from the newest checkpoint that
proves itself, then trains and saves N more. Before each save it writes the model's and optimizer's
tensors to ``EXPECTED/step-<N>.safetensors`` (outside Rewind), so a test can hold every restore of
that checkpoint, from any tier, to what was saved.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer

VOCAB, DIM = 2048, 256  # a 2 MiB frozen embedding: every checkpoint after the first links it


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, 8)


def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a state tree by path (``optimizer/state/0/exp_avg``): what a restore is compared by."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    items = (
        tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list | tuple) else ()
    )
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("root", type=Path)
    p.add_argument("expected", type=Path)
    p.add_argument("--saves", type=int, required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    net = Net()
    net.backbone.weight.requires_grad_(False)
    opt = torch.optim.AdamW(net.head.parameters(), lr=1e-2)
    states: dict[str, Any] = {"model": net, "optimizer": opt}
    ck = Checkpointer(args.run, states=states, root=args.root, catalog=Catalog(), format="chunked")
    got = ck.restore_latest()
    start = got.step if got else 0
    args.expected.mkdir(parents=True, exist_ok=True)
    for step in range(start + 1, start + 1 + args.saves):
        ids = torch.randint(0, VOCAB, (16, 12), generator=torch.Generator().manual_seed(step))
        loss = net.head(net.backbone(ids).mean(dim=1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected = flat({k: s.state_dict() for k, s in states.items()})
        save_file(
            {k: t.contiguous() for k, t in expected.items()}, str(args.expected / f"step-{step}.safetensors")
        )
        ck.save(step)
    ck.close()


if __name__ == "__main__":
    main()
