"""Detection signals, layout planning and the NVML probe (a stand-in only where no GPU exists)."""

from __future__ import annotations

import math
import signal
from types import SimpleNamespace

import pytest

from rewind.infra.errors import ConfigError
from rewind.infra.health import layout, nvml
from rewind.infra.health.signals import LossWatch, describe_exit
from rewind.infra.launch import observe
from rewind.infra.training.progress import RankState


def test_a_rank_is_silent_from_its_last_step_not_its_last_beat():
    beating = RankState(
        0, "n", 1, step=11, loss=0.5, step_at=100.0, beat_at=130.0, state="running", detail={}
    )
    assert beating.silent_for(now=131.0) == 31.0  # its thread still writes; its loop does not step
    fresh = RankState(
        1, "n", 2, step=None, loss=None, step_at=None, beat_at=130.0, state="running", detail={}
    )
    assert fresh.silent_for(now=131.0) == 1.0  # before its first step: since it first reported


def test_exit_codes_and_signals():
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"


def test_nan_and_spikes():
    w = LossWatch(spike_factor=3.0, min_history=5)
    assert all(w.observe(i, 2.0 + 0.01 * i) is None for i in range(10))
    assert w.observe(10, 5.0) is None  # 2.4x the median: not a spike
    assert w.observe(11, 9.0).kind == "loss_spike"
    assert w.observe(12, math.nan).kind == "nan"
    assert w.observe(13, math.inf).kind == "nan"


def test_layout_prefers_old_tp_then_pp_and_reports_batch_and_lr():
    shape = layout.ModelShape(heads=16, hidden=2048, layers=24)
    old = layout.Layout(tp=2, pp=2, dp=2)
    p = layout.plan(6, shape, old, global_batch=512, lr=3e-4)
    assert p.layout == layout.Layout(2, 1, 3)  # old TP kept; no PP=2 fits 3 devices; then the widest DP
    p = layout.plan(4, shape, old, global_batch=512, lr=3e-4)
    assert p.layout == layout.Layout(2, 2, 1)
    assert p.global_batch == 256 and p.lr == pytest.approx(1.5e-4)
    assert "kept TP" in p.reason and "kept PP" in p.reason
    odd = layout.plan(
        3, layout.ModelShape(heads=4, hidden=64, layers=2), layout.Layout(1, 1, 4), global_batch=64, lr=1.0
    )
    assert odd.layout == layout.Layout(1, 1, 3) and odd.global_batch == 48
    for c in layout.candidates(12, shape):
        assert c.world_size == 12 and shape.heads % c.tp == 0 and shape.layers % c.pp == 0
    with pytest.raises(ConfigError):
        layout.plan(0, shape, old, global_batch=1, lr=1.0)


def test_nvml_probe_answers_for_the_machine_it_runs_on():
    from pathlib import Path

    if not Path("/dev/nvidiactl").exists():  # no driver here: the probe must say so, not guess
        with pytest.raises(nvml.NoNvidiaDriver, match="no NVIDIA driver"):
            nvml.probe()
        return
    gpus = nvml.probe()  # a machine with a GPU: the real probe answers for every device
    assert gpus and all(g.name for g in gpus)


def _fake_nvml(temp: int, ecc: int, throttle: int, remap_pending: int):  # type: ignore[no-untyped-def]
    def not_supported(*_a):  # type: ignore[no-untyped-def]
        raise RuntimeError("NVMLError_NotSupported")

    return SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200" if h == 0 else "NVIDIA H200",
        nvmlDeviceGetTemperature=lambda h, _k: temp if h == 1 else 40,
        nvmlDeviceGetTotalEccErrors=lambda h, _t, _c: ecc if h == 1 else 0,
        nvmlDeviceGetRetiredPages=not_supported,
        nvmlDeviceGetRemappedRows=lambda h: (0, 0, remap_pending if h == 1 else 0, 0),
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: throttle if h == 1 else 0,
    )


def test_nvml_parsing_flags_sick_gpus():
    healthy, sick = nvml.read_devices(_fake_nvml(temp=91, ecc=3, throttle=0x40 | 0x4, remap_pending=1))
    assert healthy.healthy and healthy.name == "NVIDIA H200" and healthy.retired_pages is None
    assert not sick.healthy
    assert set(sick.problems) == {
        "temperature 91C",
        "3 uncorrected ECC errors",
        "row remapping pending (reset needed)",
        "throttled: hw_thermal",
    }
    assert "sw_power_cap" in sick.throttle_reasons  # reported, but power capping alone is not a fault


def _rank(rank: int, *, state: str = "running", step_at: float = 100.0, beat_at: float = 100.0, **detail):  # type: ignore[no-untyped-def]
    return RankState(
        rank, "n", rank, step=7, loss=1.0, step_at=step_at, beat_at=beat_at, state=state, detail=detail
    )


def test_a_busy_rank_gets_the_busy_limit_a_silent_one_does_not():
    lim = observe.Limits(hang_s=5.0, busy_s=300.0, world_size=2, started_at=0.0)
    saving = _rank(0, state="busy", step_at=100.0, beat_at=159.0, busy="saving")  # a 60 s save, still beating
    stepping = _rank(1, step_at=158.0, beat_at=159.0)
    assert observe.hang([saving, stepping], now=160.0, lim=lim) is None
    stalled = _rank(1, step_at=150.0, beat_at=159.0)  # beating, not stepping: stuck in a collective
    found = observe.hang([saving, stalled], now=156.0, lim=lim)
    assert found is not None and found.detail["ranks"] == [1]
    stopped = _rank(0, state="busy", step_at=100.0, beat_at=150.0, busy="saving")  # SIGSTOP: no beats either
    found = observe.hang([stopped, _rank(1, step_at=155.0, beat_at=155.5)], now=156.0, lim=lim)
    assert (
        found is not None and found.detail["ranks"] == [0] and "stopped reporting" in found.detail["reason"]
    )


def test_ranks_that_never_report_are_a_hang_after_the_busy_limit():
    lim = observe.Limits(hang_s=5.0, busy_s=300.0, world_size=2, started_at=0.0)
    one = [_rank(0, step_at=299.0, beat_at=299.0)]
    assert observe.hang(one, now=299.0, lim=lim) is None
    found = observe.hang(one, now=301.0, lim=lim)
    assert found is not None and "1 of 2 ranks never reported" in found.detail["reason"]


def test_a_spike_on_the_way_back_from_a_restore_is_seen_at_once(rewind_env, run_name):
    """The loss watch of a resumed job starts from the losses the run had at its checkpoints (the catalog
    records each save's), so a spike in the first steps after a restore is an anomaly, not unseen while
    the history fills again (a fresh watch needs 10 steps)."""
    import torch

    from rewind import TrainingSession
    from rewind.infra.training.session import TrainingAnomaly

    def run(steps: int, losses: dict[int, float]) -> int:
        model = torch.nn.Linear(2, 1)
        with TrainingSession(run_name, model=model, checkpoint_every=5, spike_factor=3.0) as s:
            start = s.start_step
            for step in s.steps(steps):
                s.report(step, losses.get(step, 1.0 + 0.01 * (step % 3)))
        return start

    assert run(20, {}) == 0  # saves at 5, 10, 15, 20 with their losses
    with pytest.raises(TrainingAnomaly, match=r"at step 21 is .*x the running median"):
        run(30, {21: 9.0})  # the first step after the restore: 9x what the run had
    assert run(30, {}) == 20  # and a normal comeback goes on


def test_layout_keeps_the_old_tp_even_with_a_device_left_idle():
    shape = layout.ModelShape(heads=4, hidden=32, layers=2)
    p = layout.plan(3, shape, layout.Layout(tp=2, pp=1, dp=2), global_batch=16, lr=3e-3)
    assert p.layout == layout.Layout(2, 1, 1)  # not TP1 x DP3: TP kept, one device idle
    assert "2 of them used" in p.reason and "kept TP" in p.reason and "global batch 16 -> 8" in p.reason
    one = layout.plan(1, shape, layout.Layout(tp=2, pp=1, dp=2), global_batch=16, lr=3e-3)
    assert one.layout == layout.Layout(1, 1, 1) and "TP 2 -> 1 (old TP does not fit)" in one.reason
    # Without a shape only the old degrees (and 1) are known to fit the model.
    blind = layout.plan(8, None, layout.Layout(tp=2, pp=2, dp=1), global_batch=4, lr=1.0)
    assert blind.layout == layout.Layout(2, 2, 2)
    assert layout.plan(3, None, layout.Layout(tp=2, pp=1, dp=2), global_batch=4, lr=1.0).layout.tp == 2


def test_layout_records_read_back_and_bad_ones_are_refused():
    assert layout.Layout.from_dict({"world_size": 4, "tp": 2, "pp": 1, "dp": 2}) == layout.Layout(2, 1, 2)
    assert layout.Layout.from_dict({"world_size": 4}) is None and layout.Layout.from_dict(None) is None
    assert layout.Layout.parse("tp=2,pp=1,dp=3") == layout.Layout(2, 1, 3)
    for bad in ("tp=2", "tp=x,pp=1,dp=1", "tp=0,pp=1,dp=1", "2x1x1"):
        with pytest.raises(ConfigError, match=r"REWIND_LAYOUT|layout"):
            layout.Layout.parse(bad)
    with pytest.raises(ConfigError, match="tp must be a whole number"):
        layout.Layout.from_dict({"tp": "2", "pp": 1, "dp": 1})
