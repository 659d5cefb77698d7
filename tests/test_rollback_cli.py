"""`rewind rollback` rolls a run back as the restore-checkpoint flow does (later checkpoints retired, the next
start resumes from the chosen step); `rewind ckpt restore` only stages a verified copy and says so."""

from __future__ import annotations

import pytest
import torch

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.checkpoint.engine import Checkpointer


def _three_steps(run: str) -> torch.nn.Linear:
    model = torch.nn.Linear(3, 3)
    ck = Checkpointer(run, states={"model": model})
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(float(step))
        ck.save(step)
    ck.close()
    return model


def test_rollback_retires_later_checkpoints_and_the_next_start_resumes_there(
    rewind_env: dict[str, str], run_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from rewind.flows.cli import main

    model = _three_steps(run_name)
    assert main(["ckpt", "restore", run_name, "--step", "2"]) == 0
    assert "staged step 2" in capsys.readouterr().out  # and nothing rolled back
    assert {c.step: c.status for c in lineage.checkpoints(Catalog(), run_name)}[3] != S.SUPERSEDED

    assert main(["rollback", run_name, "--step", "2"]) == 0
    said = capsys.readouterr().out
    assert f"rolled {run_name} back to step 2" in said and "1 later checkpoint(s) retired" in said, said
    assert {c.step: c.status for c in lineage.checkpoints(Catalog(), run_name)}[3] == S.SUPERSEDED
    fresh = Checkpointer(run_name, states={"model": model})
    got = fresh.restore_latest()
    assert got is not None and got.step == 2 and torch.all(model.weight == 2.0)
    fresh.close()
