"""A Hugging Face transformers model (a small Llama from a config, the library's own scheduler) trained
under the session API, interrupted and resumed: bit-identical to an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.trainproc import TrainProc, assert_same_weights

pytest.importorskip("transformers")


def test_hf_causal_lm_resumes_bit_exact(rewind_env, run_name, tmp_path):
    def run(name: str, out: str, *extra: str) -> TrainProc:
        p = TrainProc(
            name, tmp_path / out, steps=30, every=10, module="rewind.examples.hf_lm", extra=list(extra)
        )
        p.finish()
        assert p.proc.returncode == 0, p.output.text[-2000:]
        return p

    ref = run(f"{run_name}-ref", "ref")
    run(run_name, "cut", "--stop-after", "15")
    resumed = run(run_name, "cut")
    assert resumed.output.resumed_at == 10
    assert all(ref.output.losses[s] == loss for s, loss in resumed.output.losses.items())
    assert_same_weights(tmp_path / "cut" / "final.safetensors", tmp_path / "ref" / "final.safetensors")
