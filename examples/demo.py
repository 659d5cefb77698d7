"""The Rewind story in one command (``make demo``), on embedded defaults.

1. train tiny_lm without interruption (the reference);
2. train it again under Rewind and SIGKILL it mid-run;
3. start it again: it resumes from the newest verified checkpoint; kill it once more;
4. flip one byte in the newest checkpoint, start again: the damaged copy is
   refused and the run falls back to the one before;
5. report checkpoints and lineage, what was skipped and why, and whether the
   final weights equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from infra import config
from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.launch.process import TrainingProcess

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 60, 10


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def train(run: str, out: Path, kill_at: int | None = None) -> TrainingProcess:
    cmd = [
        sys.executable,
        "-m",
        "examples.tiny_lm",
        "--run",
        run,
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        str(EVERY),
        "--seed",
        "0",
        "--out",
        str(out),
    ]
    p = TrainingProcess(cmd, cwd=REPO)
    if kill_at is None:
        rc = p.finish(timeout=300)
        if rc != 0:
            raise SystemExit(f"training failed ({rc}):\n{p.output.text[-2000:]}")
    else:
        # Let the save at the previous step land: wait one step past it, then kill.
        if not p.wait_for(lambda line: line.startswith(f"step={kill_at} "), timeout=300):
            raise SystemExit(f"training ended before step {kill_at}:\n{p.output.text[-2000:]}")
        p.kill()
        say(f"SIGKILLed pid {p.pid} right after step {kill_at}")
    if p.output.resumed_at is not None:
        say(f"resumed at step {p.output.resumed_at} (first step run: {min(p.output.losses)})")
    for line in p.output.lines:
        if line.startswith("rewind: skipped"):
            say(line.removeprefix("rewind: "))
    return p


def same_weights(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}", help="run name prefix")
    args = p.parse_args(argv)
    cat = Catalog()
    work = config.home() / "demo" / args.name
    say(f"catalog {cat.safe_url}; checkpoints under {config.checkpoint_root()}")
    t0 = time.monotonic()

    say("1/4 reference: 60 uninterrupted steps")
    ref = train(f"{args.name}-reference", work / "reference")
    say("2/4 protected run, killed at step 35")
    first = train(args.name, work / "run", kill_at=35)
    say("3/4 restart: resumes, then is killed again at step 45")
    second = train(args.name, work / "run", kill_at=45)
    newest = lineage.restorable(cat, lineage.get_run(cat, args.name).id)[0]
    target = Path(newest.path) / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    say(f"4/4 flipped one bit in {target} (step {newest.step}); restart")
    third = train(args.name, work / "run")

    losses = {**first.output.losses, **second.output.losses, **third.output.losses}
    equal_losses = losses == ref.output.losses
    equal_weights = same_weights(work / "run" / "final.safetensors", work / "reference" / "final.safetensors")

    print("\n=== Rewind demo report ===")
    print(f"run {args.name}: {len(losses)} steps over 3 processes (2 SIGKILLs, 1 damaged checkpoint)\n")
    rows = lineage.checkpoints(cat, args.name)
    by_id = {c.id: c for c in rows}
    print(f"{'step':>5}  {'status':10} {'parent':>6}  {'bytes':>9}  {'stall_s':>7}  reason")
    for c in rows:
        parent = by_id[c.parent_id].step if c.parent_id in by_id else "-"
        stall = f"{c.save_stall_s:.3f}" if c.save_stall_s is not None else "-"
        print(
            f"{c.step:>5}  {c.status:10} {parent!s:>6}  {c.total_bytes or 0:>9}  {stall:>7}  {c.status_reason or ''}"
        )
    print()
    print(f"losses of all {len(losses)} steps equal the uninterrupted run: {equal_losses}")
    print(f"final weights bit-identical to the uninterrupted run:       {equal_weights}")
    print(f"demo took {time.monotonic() - t0:.1f}s")
    return 0 if equal_losses and equal_weights else 1


if __name__ == "__main__":
    sys.exit(main())
