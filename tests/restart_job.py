"""A one-process job whose step raises once (at ``fail_at``, if given), trained through
``TrainingSession.train(..., restarts=N)``: the final weights, and how the run went, as JSON lines.

    python -m tests.restart_job RUN OUT_DIR STEPS RESTARTS [FAIL_AT [scaler|scaler-off]]

``scaler``: the step scales its loss with a ``GradScaler`` (checkpointed with the job) and fails after
``unscale_``, before the optimizer's step, as a gradient-norm check that raises does; ``scaler-off``: the
same with the scaler disabled (``enabled=False``, as a job run without mixed precision makes it).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

from rewind import ResumableLoader, TrainingSession


def main(run: str, out: str, steps: int, restarts: int, fail_at: int | None, scaled: str = "") -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x @ torch.randn(16, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = ResumableLoader(dataset, batch_size=16, seed=0)
    failed: list[int] = []
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled == "scaler")

    def scaled_step(i: int, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        xb, yb = batch
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if i == fail_at and not failed:
            failed.append(i)
            raise RuntimeError(f"a transient device error at step {i}")
        scaler.step(opt)
        scaler.update()
        return loss.item()

    def step(i: int, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        xb, yb = batch
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()  # the state moves on before the failure: the restart must undo it
        if i == fail_at and not failed:
            failed.append(i)
            raise RuntimeError(f"a transient device error at step {i}")
        return loss.item()

    states = {"scaler": scaler} if scaled else None
    with TrainingSession(
        run, model=model, optimizer=opt, states=states, loader=loader, checkpoint_every=10
    ) as s:
        last = s.train(scaled_step if scaled else step, steps, restarts=restarts)
        print(json.dumps({"last": last, "restarts": s._restarts}), flush=True)
    os.makedirs(out, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out, "final.safetensors")
    )


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        int(sys.argv[5]) if len(sys.argv) > 5 else None,
        sys.argv[6] if len(sys.argv) > 6 else "",
    )
