"""A process whose launch has ended (its host cut off, the job relaunched elsewhere) never commits another
checkpoint, though it is alive, holds the run's writer name, and can still reach the catalog; nor does it
take away the checkpoint the run holds at the step it saves again (the relaunch's, which it would supersede)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rewind.infra.catalog import jobs, leases, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus as S

REPO = Path(__file__).resolve().parents[1]

# Saves step 1, says so, then for each step read on stdin tries it and says what happened.
ORPHAN = textwrap.dedent(
    """
    import sys, torch
    from rewind.infra.catalog.db import Catalog
    from rewind.infra.checkpoint.engine import Checkpointer
    from rewind.infra.errors import Fenced
    url, run, root = sys.argv[1:4]
    ck = Checkpointer(run, states={"model": torch.nn.Linear(4, 4)}, root=root, catalog=Catalog(url))
    ck.save(1)
    print("saved 1", flush=True)
    for line in sys.stdin:
        try:
            ck.save(int(line))
            print("saved", int(line), flush=True)
        except Fenced as exc:
            print("fenced:", exc, flush=True)
    """
)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.timeout(180)
def test_a_rank_of_an_ended_launch_never_commits_again(
    backend: str, tmp_path: Path, pg_url: str, run_name: str
) -> None:
    url = {"sqlite": f"sqlite:///{tmp_path / 'catalog.db'}", "postgres": pg_url}[backend]
    cat = Catalog(url)
    launch = jobs.begin_launch(cat, run_name, {"command": ["python"]}, {})
    env = {**os.environ, "REWIND_LAUNCH_ID": str(launch)}
    orphan = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, url, run_name, str(tmp_path / "ckpt")], cwd=REPO, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert orphan.stdout is not None and orphan.stdin is not None
        assert orphan.stdout.readline().strip() == "saved 1"
        jobs.end_launch(cat, launch, -9)  # its supervisor saw the launch end: the job goes on elsewhere
        said, _ = orphan.communicate("2\n1\n", timeout=120)  # a new step, then the step the run holds
    finally:
        orphan.kill()
    lines = said.splitlines()
    assert len(lines) == 2 and all(
        x.startswith("fenced:") and "no longer the run's writer" in x for x in lines
    ), said
    run_id = lineage.get_run(cat, run_name).id
    states = {c.step: c.status for c in lineage.checkpoints(cat, run_name)}
    assert states == {1: S.COMMITTED}, states  # step 1 not superseded, step 2 never begun
    (step1,) = lineage.checkpoints(cat, run_name, 1)
    assert (Path(step1.path) / "manifest.json").is_file()  # nor its directory moved aside
    leases.take_writer(cat, run_id, who="relaunch:1:99")  # the relaunch takes the run over at once
