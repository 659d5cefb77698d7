"""Ranks of a job whose hosts have their own disks, on one machine: each rank's checkpoint root is the
disk its argument names (``a,a,b,b``: ranks 0-1 on disk a, 2-3 on disk b), as node-local disks at one
path would be on real hosts (and with ``REWIND_TEST_RING`` set, each its own memory tier beside it, the
peer ring on; with ``REWIND_TEST_ASYNC``, async saves). Saves (``save``) or restores (``load``) through
``ShardedCheckpointer``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.dist_worker import _full, _model, _wrap, init_optimizer_state

RUN = "spread"


def main(mode: str, workdir: str, layout: str) -> None:
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.sharded import ShardedCheckpointer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = Path(workdir)
    disk = layout.split(",")[rank]
    root = work / "disks" / disk
    if os.environ.get("REWIND_TEST_RING"):  # each host's memory tier: its own, like its disk
        os.environ["REWIND_MEMORY_ROOT"] = str(work / "memory" / disk)
    catalog = Catalog(f"sqlite:///{work / 'catalog.db'}") if rank == 0 else None
    model = _wrap(_model(), "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    save_mode = "async" if os.environ.get("REWIND_TEST_ASYNC") else "sync"
    ck = ShardedCheckpointer(RUN, root=root, catalog=catalog, mode=save_mode)
    if mode == "save":
        held: list[str] = []  # what the held pass's release found (sync saves, the ring's pass held)
        for step in (1, 2):
            torch.manual_seed(100 + rank * 10 + step)
            model(torch.randn(4, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            msd, osd = get_state_dict(model, opt)
            ck.save(step, {"model": msd, "optim": osd}, {"rank": rank, "step": step})
            if save_mode == "async":
                ck.wait()  # committed (and passed round the ring) before the next step
            elif step == 1 and os.environ.get("REWIND_FAULT", "").startswith("hold:ring.pass"):
                _pass_runs_after_the_save(ck, work, held)
            elif step == 2:
                assert held in ([], ["nothing of step 2 written"]), held
            # each host's share of this step sent before the next save: a save that finds a sender still busy
            # skips the shared tier (by design), and on a loaded machine step 1's sending can outlast step 2
            pusher = ck.send_on.pusher
            assert pusher is None or pusher.wait(120), "the share was not sent within 120 s"
            dist.barrier()
        name = "expected"
    else:

        def state() -> dict[str, object]:
            init_optimizer_state(model, opt)
            msd, osd = get_state_dict(model, opt)
            return {"model": msd, "optim": osd}

        try:
            got = ck.restore_latest(state)
        except Exception as exc:
            if rank == 0:
                (work / "refused.txt").write_text(f"{type(exc).__name__}: {exc}")
            raise SystemExit(3) from exc
        assert got is not None
        step, restored, mine = got
        set_state_dict(model, opt, model_state_dict=restored["model"], optim_state_dict=restored["optim"])
        assert mine == {"rank": rank, "step": step}, mine
        name = "loaded"
        if rank == 0:
            sources = [s.as_dict() for s in ck.sources]
            (work / "sources.json").write_text(
                json.dumps({"step": step, "disks": sources, "loaded": ck.loaded})
            )
    full = _full(model, opt)
    if rank == 0:
        save_file(full, str(work / f"{name}.safetensors"))
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _pass_runs_after_the_save(ck: object, work: Path, found: list[str]) -> None:
    """Sync saves, the ring's pass held on one rank (``REWIND_FAULT=hold:ring.pass@1%<rank>``): there the
    save returned while its pass waits on the rank's runner. The pass is let go a second into the next save,
    which must not write anything before it ends (every rank's save waits for its own pass, and the others'
    passes for the held one); ``close`` waits for the last pass. No other wait between them."""
    release = Path(os.environ["REWIND_FAULT_RELEASE"])
    held = Path(f"{release}.held")
    if os.environ.get("RANK") != os.environ["REWIND_FAULT"].rpartition("%")[2]:
        return
    deadline = time.monotonic() + 120
    while not held.exists():  # the runner's thread reaches the point after the save returned
        assert time.monotonic() < deadline, "the ring's pass never started after the sync save"
        time.sleep(0.02)
    assert ck._runner.busy and not release.exists()  # type: ignore[attr-defined]

    def let_go() -> None:
        threading.Event().wait(1.0)  # the next save has had a second to write, were it not waiting
        written = [p.name for d in (work / "disks").iterdir() for p in (d / RUN).glob("*step-2*")]
        found.append(
            f"step 2 written before the pass ended: {written}" if written else "nothing of step 2 written"
        )
        release.touch()

    threading.Thread(target=let_go, daemon=True).start()


if __name__ == "__main__":
    main(*sys.argv[1:4])
