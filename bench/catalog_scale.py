"""Catalog scale: listing, restore planning and retention planning against 100,000 checkpoints in Postgres.

    .venv/bin/python -m bench.catalog_scale [--runs 91] [--per-run 990] [--big-run 10000] [--repeat 5]

Creates its own database on 127.0.0.1:5432 (trust auth, user postgres; ``REWIND_TEST_PG_ADMIN``
names another server), applies the migrations as the catalog does, and fills it in bulk
(``bench/synthetic_catalog.py``): by default 90 runs of 990 checkpoints and one of 10,900, so
100,000 on the live chains, plus abandoned branches, aborted saves, files, copies on two or three
tiers, incidents, pins and leases. Then it measures the real code paths, median of ``--repeat``:

- ``rewind ckpt list RUN`` (text, newest page; and ``--json``, every checkpoint of the run),
  ``rewind runs list`` and ``rewind status`` (every run), run in-process through ``rewind.flows.cli.main``
  (each call opens the catalog as a fresh command does; interpreter start and imports excluded), and
  ``rewind ckpt list RUN`` once as a subprocess (everything included);
- a restore plan (``rewind.infra.restore.plan.plan``) for a 990-checkpoint run and for the 10,900 one;
- a retention plan (``rewind.infra.retention.plan``) for a run that was rolled back once, and the check
  retention makes before deleting each copy (``locations.location_in_use``, a shared copy);
- the scrub's list of what to check in the 10,900-checkpoint run (``rewind.tasks.verify.list_checkpoints``).

Each figure comes with the number of SQL statements it issued. Writes ``catalog_list_s_100k``
(``ckpt list RUN``, text), ``restore_plan_s_100k`` (990-checkpoint run), ``gc_plan_s_100k``,
``status_s_100k`` (``rewind status --json``, every run) and the rest under ``catalog_scale`` to bench/results.json. The database is dropped at the end, also
on failure.

"10 million chunk references": the catalog holds no per-chunk rows. A chunked checkpoint's chunk
references live in its manifest (``chunks.json``), whose digest the catalog records, so that part of
the criterion is carried by the manifests on the tiers, not by Postgres.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, event, text

from bench.run import machine
from bench.synthetic_catalog import Shape, build, fork_run, run_name
from rewind.infra.catalog.db import Catalog

HERE = Path(__file__).resolve().parent
ADMIN_URL = os.environ.get("REWIND_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextlib.contextmanager
def database(prefix: str = "rewind_bench_scale") -> Iterator[str]:
    """A new, empty Postgres database for the duration; dropped afterwards whatever happened."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{ADMIN_URL.rsplit('/', 1)[0].replace('postgresql://', 'postgresql+psycopg://')}/{name}"
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Statements:
    """Counts the SQL statements every engine in this process sends while it is active."""

    def __init__(self) -> None:
        self.count = 0

    def _seen(self, *_: Any) -> None:
        self.count += 1

    def __enter__(self) -> Statements:
        event.listen(Engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *_: object) -> None:
        event.remove(Engine, "before_cursor_execute", self._seen)


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, int]:
    """Median seconds of ``repeat`` calls, and the statements one call sends."""
    fn()  # warm: imports, the first connection's authentication
    times = []
    for _ in range(repeat):
        with Statements() as st:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), st.count


def cli(argv: list[str]) -> Callable[[], str]:
    """``rewind ARGV`` in this process, its output kept from the terminal."""
    from rewind.flows.cli import main

    def call() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(argv)
        if rc != 0:
            raise RuntimeError(f"rewind {' '.join(argv)} exited {rc}")
        return out.getvalue()

    return call


def subprocess_s(argv: list[str], repeat: int) -> float:
    rewind = str(Path(sys.executable).parent / "rewind")
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([rewind, *argv], check=True, capture_output=True, timeout=300)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dead_shared_copy(cat: Catalog) -> int:
    """A shared copy of an abandoned branch: retention asks whether its key is someone else's before deleting it."""
    with cat.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT replica.id FROM replica JOIN checkpoint ON checkpoint.id = replica.checkpoint_id"
                    " WHERE checkpoint.status = 'superseded' AND replica.tier = 'shared' LIMIT 1"
                )
            ).scalar_one()
        )


def _planned(retention: Any, cat: Catalog, run: str, work: Path) -> Any:
    proves, retention._proves_now = retention._proves_now, lambda cat, checkpoint_id: True
    try:
        return retention.plan(cat, run, retention.Policy(keep_every=50), root=work)
    finally:
        retention._proves_now = proves


def measure(url: str, shape: Shape, repeat: int, work: Path) -> dict[str, Any]:
    from rewind.infra import retention
    from rewind.infra.catalog import locations
    from rewind.infra.restore import plan
    from rewind.tasks.verify import list_checkpoints

    cat = Catalog(url)  # applies the migrations, as `rewind db upgrade` would
    t0 = time.perf_counter()
    with cat.engine.begin() as conn:
        counts = build(conn, shape)
    built_s = time.perf_counter() - t0
    print(f"built in {built_s:.1f} s: " + ", ".join(f"{n:,} {t}" for t, n in counts.items()), flush=True)
    os.environ |= {"REWIND_CATALOG_URL": url, "REWIND_HOME": str(work), "REWIND_CHECKPOINT_ROOT": str(work)}
    big, small, forked = run_name(1), run_name(2), run_name(fork_run(shape))
    dead_copy = _dead_shared_copy(cat)
    figures: dict[str, tuple[float, int]] = {
        "ckpt_list": timed(cli(["ckpt", "list", small]), repeat),
        "ckpt_list_json": timed(cli(["ckpt", "list", small, "--json"]), repeat),
        "ckpt_list_big": timed(cli(["ckpt", "list", big]), repeat),
        "runs_list": timed(cli(["runs", "list"]), repeat),
        "status_all": timed(cli(["status", "--json"]), repeat),
        "status_text": timed(cli(["status"]), repeat),
        "scrub_list_big": timed(lambda: list_checkpoints.fn(big), repeat),
        "restore_plan": timed(lambda: plan.plan(cat, small, root=work), repeat),
        "restore_plan_big": timed(lambda: plan.plan(cat, big, root=work), repeat),
        "gc_copy_in_use_check": timed(lambda: locations.location_in_use(cat, dead_copy), repeat),
        # planning only: the proof of what is kept reads keep_last checkpoints' bytes, and these rows have none
        "gc_plan": timed(lambda: _planned(retention, cat, forked, work), repeat),
    }
    res: dict[str, Any] = {f"{k}_s": round(s, 4) for k, (s, _) in figures.items()}
    res |= {f"{k}_statements": n for k, (_, n) in figures.items()}
    res |= {
        "ckpt_list_subprocess_s": round(subprocess_s(["ckpt", "list", small], 3), 4),
        "build_s": round(built_s, 1),
        "rows": counts,
        "shape": f"{shape.runs} runs, {shape.per_run} checkpoints each, run 1 {shape.size(1)}",
        "repeat": repeat,
    }
    cat.close()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=91)
    p.add_argument("--per-run", type=int, default=990)
    p.add_argument("--big-run", type=int, default=10_900, help="checkpoints of run 1")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    shape = Shape(runs=args.runs, per_run=args.per_run, big_run_size=args.big_run)
    with database() as url, tempfile.TemporaryDirectory(prefix="rewind-bench-scale-") as tmp:
        res = measure(url, shape, args.repeat, Path(tmp))
    for k, v in res.items():
        print(f"  {k:28} {v}")
    out = HERE / "results.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    results |= {
        "catalog_list_s_100k": res["ckpt_list_s"],
        "restore_plan_s_100k": res["restore_plan_s"],
        "gc_plan_s_100k": res["gc_plan_s"],
        "status_s_100k": res["status_all_s"],
        "catalog_scale": res,
    }
    results.setdefault("machine", machine())
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
