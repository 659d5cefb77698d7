"""The chunked format under torchrun (gloo, FSDP2): each rank's items in packs, a frozen backbone linked
from the parent checkpoint, not written again; saved by 2 ranks, restored bit-exact on 2 and on 1."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rewind.infra.format import manifest as mf
from tests.torchrun_support import torchrun

REPO = Path(__file__).resolve().parent.parent
BACKBONE_BYTES = 8192 * 128 * 4  # tests/chunked_sharded_worker.py's frozen embedding


def _run(n: int, mode: str, root: Path) -> str:
    done = subprocess.run(
        [*torchrun(n), "-m", "tests.chunked_sharded_worker", mode, str(root)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _packs(step_dir: Path) -> tuple[int, int]:
    """(bytes of the packs the manifest lists, bytes of those that are hard links to an earlier save's)."""
    entries = [e for e in mf.read(step_dir).files if e.path.startswith("packs/")]
    linked = sum(e.size for e in entries if (step_dir / e.path).stat().st_nlink > 1)
    return sum(e.size for e in entries), linked


def test_the_chunked_format_saved_by_two_ranks_links_the_frozen_backbone_and_restores_on_two_and_one(
    tmp_path: Path,
) -> None:
    out = _run(2, "save", tmp_path)  # then restored by the same 2 ranks into a fresh model and optimizer
    assert out.count(": same") == 2, out
    run_dir = tmp_path / "chunked"
    total, linked = _packs(run_dir / "step-3")
    assert linked >= BACKBONE_BYTES, f"only {linked} of {total} pack bytes linked"
    written = total - linked
    assert written < 0.05 * total, f"step 3 wrote {written} of {total} pack bytes: the backbone again"
    out = _run(1, "restore", tmp_path)
    assert out.count(": same") == 1, out
