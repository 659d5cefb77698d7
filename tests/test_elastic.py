"""A 4-rank job loses a rank; relaunched on 3 ranks it resumes resharded with the data order intact."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rewind.examples.runner import TrainingProcess
from rewind.examples.tiny_lm import command
from rewind.examples.tiny_lm_model import CharDataset, corpus
from rewind.infra.training.data import epoch_order

REPO = Path(__file__).resolve().parents[1]


def ddp_cmd(run: str, out: Path, nproc: int, log: Path) -> list[str]:
    return command(
        run,
        out,
        steps=30,
        every=5,
        extra=["--nproc", str(nproc), "--sample-log", str(log)],
        module="rewind.examples.tiny_lm_ddp",
    )


def test_lost_rank_relaunch_on_three_resumes_resharded(rewind_env, run_name, tmp_path):
    log, dumps = tmp_path / "samples", tmp_path / "dumps"
    log.mkdir()
    env = {"TINY_LM_DUMP_DIR": str(dumps), "OMP_NUM_THREADS": "1"}
    # Rank 2 (its device) is lost in the middle of the step-15 save: 10 is the newest checkpoint, whatever the timing.
    lose_rank_2 = {**env, "REWIND_FAULT": "kill:save.shard_written@15%2"}
    first = TrainingProcess(ddp_cmd(run_name, tmp_path / "out", 4, log), cwd=REPO, env=lose_rank_2)
    assert first.finish(timeout=300) != 0, first.output.text[-3000:]
    assert "step=14 " in first.output.text and "step=16 " not in first.output.text

    second = TrainingProcess(ddp_cmd(run_name, tmp_path / "out", 3, log), cwd=REPO, env=env)
    assert second.finish(timeout=300) == 0, second.output.text[-3000:]
    assert "resumed run" in second.output.text and "at step 10 on 3 ranks" in second.output.text

    # Optimizer state (and parameters) after resharding 4 -> 3 equal what the 4 ranks saved.
    saved, restored = (
        load_file(str(dumps / "saved-10.safetensors")),
        load_file(str(dumps / "restored-10.safetensors")),
    )
    assert saved.keys() == restored.keys() and any(k.startswith("optim/") for k in saved)
    for k in saved:
        assert torch.equal(saved[k], restored[k]), k

    # The global sample order: steps 1-10 from the 4-rank run, 11-30 from the 3-rank run.
    taken: list[int] = []
    for rank_log in sorted(log.glob("rank-*.log")):
        for line in rank_log.read_text().splitlines():
            rec = json.loads(line)
            if (rec["world"] == 4 and rec["step"] <= 10) or (rec["world"] == 3 and rec["step"] > 10):
                taken += rec["samples"]
    expected = epoch_order(len(CharDataset(corpus(), 32)), 0, 0)[: 10 * 64 + 20 * 48].tolist()
    assert len(taken) == len(expected), "a sample was skipped or repeated"
    assert sorted(taken) == sorted(expected), "the resumed run left the global sample order"
