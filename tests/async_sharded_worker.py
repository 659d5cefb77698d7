"""Worker for the async sharded save tests (gloo on CPU, FSDP2 or DDP): ``python -m tests.async_sharded_worker
KIND ROOT``. Every rank saves asynchronously, changes its parameters in place the moment ``save`` returned,
restores at once (no explicit wait: the restore must wait for the save in flight) and checks that what it
got back is the state of the call, not the state changed after it. Prints ``copy-safe`` per rank."""

from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import SaveMode
from rewind.infra.checkpoint.sharded import ShardedCheckpointer


def _wrap(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    return torch.nn.parallel.DistributedDataParallel(model)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: _local(v).detach().clone() for k, v in model.state_dict().items()}


def main(kind: str, root: str, what: str = "copy", mode: str = "async") -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))  # a rank left waiting fails the test
    checks = {
        "copy": _check,
        "leadfails": _lead_fails,
        "onefails": lambda k, r: _one_fails(k, r, SaveMode(mode)),
    }
    same = checks[what](kind, root)  # its models and tensors freed on return, while the group still exists
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0 if same else 1)


def _check(kind: str, root: str) -> bool:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _wrap(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)), kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 256)).pow(2).mean().backward()
    opt.step()
    catalog = Catalog(f"sqlite:///{Path(root) / 'catalog.db'}") if rank == 0 else None
    ck = ShardedCheckpointer("copysafe", root=Path(root), catalog=catalog, mode=SaveMode.ASYNC)
    msd, osd = get_state_dict(model, opt)
    if kind == "fsdp2":  # shells made in the background, the save copies into them; ddp's made at the save
        ck.prepare({"model": msd, "optim": osd})
    before = _snapshot(model)
    ck.save(7, {"model": msd, "optim": osd}, {"rank": rank})
    with torch.no_grad():  # the moment save() returned: these values must not reach the checkpoint
        for p in model.parameters():
            p.add_(1.0)
    restored = ck.restore_latest(
        lambda: dict(zip(("model", "optim"), get_state_dict(model, opt), strict=True))
    )
    assert restored is not None, "nothing restored"
    step, tree, mine = restored
    set_state_dict(model, opt, model_state_dict=tree["model"], optim_state_dict=tree["optim"])
    after = _snapshot(model)
    same = step == 7 and mine == {"rank": rank} and all(torch.equal(before[k], after[k]) for k in before)
    _say(f"rank {rank}: {'copy-safe' if same else 'CHANGED'} step {step}")
    ck.close()
    return same


def _lead_fails(kind: str, root: str) -> bool:
    """Rank 0's catalog fails at step 7 (REWIND_FAULT=eio:save.before_catalog@7): every rank must hear of
    it from its next call, and the save after it (step 8) must hold every rank's step-8 values."""
    from rewind.infra.checkpoint.background import BackgroundSaveError

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _wrap(torch.nn.Sequential(torch.nn.Linear(64, 64)), kind)
    catalog = Catalog(f"sqlite:///{Path(root) / 'catalog.db'}") if rank == 0 else None
    ck = ShardedCheckpointer("leadfails", root=Path(root), catalog=catalog, mode=SaveMode.ASYNC)
    ck.save(7, {"model": model.state_dict()}, {"rank": rank, "step": 7})
    try:
        ck.wait()
        heard = "nothing"
    except BackgroundSaveError as exc:
        heard = "rank 0 before any rank wrote" if "before any rank wrote" in str(exc) else str(exc)
    ok = _step_8_whole(ck, model, rank, heard)
    return ok and heard.startswith("rank 0")


def _one_fails(kind: str, root: str, mode: SaveMode) -> bool:
    """Rank 1's own state cannot be saved at step 7 (a set: no checkpoint holds one) while rank 0's can: every
    rank must hear of it from the save, naming rank 1, none left waiting in DCP's collectives; and the save
    after it (step 8) must be whole, its group unbroken."""
    from rewind.infra.checkpoint.background import BackgroundSaveError
    from rewind.infra.errors import RankFailed

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _wrap(torch.nn.Sequential(torch.nn.Linear(64, 64)), kind)
    catalog = Catalog(f"sqlite:///{Path(root) / 'catalog.db'}") if rank == 0 else None
    ck = ShardedCheckpointer("onefails", root=Path(root), catalog=catalog, mode=mode)
    try:
        ck.save(
            7, {"model": model.state_dict()}, {"rank": rank, "seen": {1, 2}} if rank == 1 else {"rank": rank}
        )
        ck.wait()
        heard = "nothing"
    except (RankFailed, BackgroundSaveError) as exc:
        heard = (
            "rank 1's state" if "rank 1: ConfigError" in str(exc) and "rank1.seen" in str(exc) else str(exc)
        )
    ok = _step_8_whole(ck, model, rank, heard)
    return ok and heard == "rank 1's state"


def _step_8_whole(ck: ShardedCheckpointer, model: torch.nn.Module, rank: int, heard: str) -> bool:
    """After a failed save: the parameters changed, saved at step 8 and restored; whether what came back is
    what was saved (said with ``heard``, what the failed save told this rank). Closes ``ck``."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    want = _snapshot(model)
    ck.save(8, {"model": model.state_dict()}, {"rank": rank, "step": 8})
    restored = ck.restore_latest(lambda: {"model": model.state_dict()})
    step, tree, mine = restored if restored is not None else (None, {}, {})
    got = {k: _local(v).detach().clone() for k, v in tree.get("model", {}).items()}
    ok = step == 8 and mine == {"rank": rank, "step": 8} and all(torch.equal(want[k], got[k]) for k in want)
    _say(f"rank {rank}: heard {heard}; {'restored step 8' if ok else f'WRONG {step} {mine}'}")
    ck.close()
    return ok


def _say(line: str) -> None:
    """One line in one write: both ranks share the pipe, and print() writes the text and its newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
