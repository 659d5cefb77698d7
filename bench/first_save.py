"""The first async save of a process: its stall with the staging buffer made at the save, and with it made
in the background beforehand (``Checkpointer.prepare``, as ``TrainingSession`` does at its first report);
a later save's stall beside them. Each contender runs in a process of its own (a process's first touch of
its memory is the cost measured), alternating, ``--repeat`` times each.

Run by ``python -m bench.run --sections first`` (or ``python -m bench.first_save``; writes its keys into
bench/results.json either way).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.run import HERE, Blob, median
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.engine import Checkpointer, SaveMode

CONTENDERS = ("unprepared", "prepared")


def one(how: str, work: Path, gib: float) -> dict[str, float]:
    """In this process: the first save's stall (prepared or not) and the second's."""
    blob = Blob(gib)
    cat = Catalog(f"sqlite:///{work / 'first.db'}")
    ck = Checkpointer(
        "bench-first", states={"model": blob}, root=work / "ck", catalog=cat, mode=SaveMode.ASYNC
    )
    prepared_s = 0.0
    if how == "prepared":
        t0 = time.perf_counter()
        ck.prepare()
        ck.wait()  # the job's steps between its first report and its first save
        prepared_s = time.perf_counter() - t0
    first = ck.save(1)
    ck.wait()
    later = ck.save(2)
    ck.close()
    return {"first_stall_s": first, "later_stall_s": later, "prepare_s": prepared_s, "bytes": blob.nbytes}


def measure(work: Path, gib: float, repeat: int) -> dict[str, Any]:
    got: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
    for i in range(repeat):
        for how in CONTENDERS:
            d = work / f"{how}-{i}"
            d.mkdir(parents=True)
            cmd = [sys.executable, "-m", "bench.first_save", "--one", how, "--gib", str(gib), "--dir", str(d)]
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=600, check=True, cwd=HERE.parent
            )
            got[how].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out: dict[str, Any] = {"bytes": got["prepared"][0]["bytes"], "repeat": repeat}
    for how in CONTENDERS:
        out[f"first_stall_{how}_s"] = median([r["first_stall_s"] for r in got[how]])
    out["later_stall_s"] = median([r["later_stall_s"] for r in got["unprepared"] + got["prepared"]])
    out["prepare_s"] = median([r["prepare_s"] for r in got["prepared"]])
    return out


def report(results: dict[str, Any], m: dict[str, Any]) -> None:
    gb = m["bytes"] / 1e9
    print(f"\n== first async save of a process, {gb:.2f} GB (median of {m['repeat']} processes each) ==")
    print(f"  staging buffer made at the save      {m['first_stall_unprepared_s']:8.3f} s stall")
    print(f"  made beforehand in the background    {m['first_stall_prepared_s']:8.3f} s stall"
          f"   (prepare took {m['prepare_s']:.3f} s in the background)")  # fmt: skip
    print(f"  a later save                         {m['later_stall_s']:8.3f} s stall")
    results["first_save"] = m
    results["first_save_stall_ratio_prepared"] = m["first_stall_prepared_s"] / m["first_stall_unprepared_s"]
    results["first_save_stall_ratio_prepared_vs_later"] = m["first_stall_prepared_s"] / m["later_stall_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--one", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one, args.dir, args.gib)))
        return 0
    out = HERE / "results.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="rewind-first-", dir=args.dir or HERE) as work:
        report(results, measure(Path(work), args.gib, args.repeat))
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
