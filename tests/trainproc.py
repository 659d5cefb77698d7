"""Run ``rewind.examples.tiny_lm`` as a real subprocess and compare results."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from rewind.examples.runner import Output, TrainingProcess
from rewind.examples.tiny_lm import command

REPO = Path(__file__).resolve().parents[1]


class TrainProc(TrainingProcess):
    def __init__(self, run: str, out: Path, *, env: dict[str, str] | None = None, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(command(run, out, **kw), cwd=REPO, env=env)

    def wait_for(self, pred, timeout: float = 120) -> bool:  # type: ignore[no-untyped-def,override]
        return super().wait_for(pred, timeout)

    def finish(self, timeout: float = 180) -> Output:  # type: ignore[override]
        super().finish(timeout)
        return self.output


def run_to_end(run: str, out: Path, **kw) -> tuple[int, Output]:  # type: ignore[no-untyped-def]
    p = TrainProc(run, out, **kw)
    o = p.finish()
    return p.proc.returncode, o


def assert_same_weights(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"tensor {k} differs"


def uninterrupted(argv: list[str], home: Path) -> Path:
    """Run ``argv`` (a Python command line) to its end, unsupervised, in its own SQLite catalog under
    ``home``; the final weights it writes to ``home/out``."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "REWIND_HOME": str(home), "REWIND_CATALOG_URL": "", "REWIND_CHECKPOINT_ROOT": "",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("REWIND_FAULT", None)
    done = subprocess.run([sys.executable, *argv[1:]], cwd=home, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return home / "out" / "final.safetensors"
