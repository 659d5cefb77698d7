"""A sick GPU is left out by its index: the relaunch sees only the others (not one rank fewer on the same
devices), the exclusion outlives later relaunches, and a machine with no healthy GPU is not relaunched onto.

NVML is the one stand-in allowed on a machine without a GPU: ``read_devices`` reads a fake with NVML's
functions, through the supervisor's seam; the job, the supervisor, the catalog and the rebuild are real."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rewind.infra.catalog import incidents, jobs
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import Refused
from rewind.infra.health import nvml
from rewind.infra.launch import rebuild
from rewind.infra.launch.spec import JobSpec
from rewind.infra.phases import detect
from rewind.infra.phases.notify import LogNotifier
from rewind.infra.phases.rebuild import rebuild_environment
from tests.prefect_support import wait_until


def _nvml(count: int, sick: set[int]) -> SimpleNamespace:
    """NVML's functions for ``count`` GPUs; those in ``sick`` report uncorrected ECC errors."""
    return SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1,
        nvmlDeviceGetCount=lambda: count, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA H200", nvmlDeviceGetTemperature=lambda h, _k: 40,
        nvmlDeviceGetTotalEccErrors=lambda h, _t, _c: 7 if h in sick else 0,
        nvmlDeviceGetRetiredPages=lambda h, _c: [], nvmlDeviceGetRemappedRows=lambda h: (0, 0, 0, 0),
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0,
    )  # fmt: skip


def test_the_rebuild_leaves_the_sick_gpu_out_not_the_last_rank():
    full = JobSpec(command=("python", "train.py"), nproc_per_node=4)
    first = rebuild.plan(
        full, full, "gpu", lost_node=None, shrink=True, devices=rebuild.Devices(every=(0, 1, 2, 3), sick=(1,))
    )
    assert first.spec.nproc_per_node == 3 and first.handoff["exclude_gpus"] == [1]  # 0, 2, 3 stay
    assert "leaving out sick GPU(s) 1" in first.decision
    again = rebuild.plan(
        full, first.spec, "gpu", lost_node=None, shrink=True,
        devices=rebuild.Devices(every=(0, 1, 2, 3), sick=(3,), excluded=(1,)),
    )  # fmt: skip
    assert again.spec.nproc_per_node == 2 and again.handoff["exclude_gpus"] == [1, 3]
    crash = rebuild.plan(
        full, again.spec, "crash", lost_node=None, shrink=True,
        devices=rebuild.Devices(every=(0, 1, 2, 3), sick=(), excluded=(1, 3)),
    )  # fmt: skip
    assert crash.handoff["exclude_gpus"] == [1, 3]  # a later crash never brings a sick GPU back
    one = JobSpec(command=("python", "train.py"))
    with pytest.raises(Refused, match="every GPU of this machine is sick"):  # not the same GPU again
        rebuild.plan(
            one, one, "gpu", lost_node=None, shrink=True, devices=rebuild.Devices(every=(0,), sick=(0,))
        )


JOB = (
    "import os, sys, time\n"
    "print('visible', os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n"
    "if 'CUDA_VISIBLE_DEVICES' not in os.environ: time.sleep(120)\n"  # the first launch runs until stopped
)


@pytest.mark.timeout(180)
def test_a_job_stopped_for_a_sick_gpu_comes_back_on_the_other_gpus(rewind_env, run_name, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cat, notify = Catalog(), LogNotifier()
    spec = JobSpec(command=(sys.executable, "-c", JOB))
    jobs.set_spec(cat, run_name, spec.as_dict())  # as protect-training records it
    sick = detect.supervise(
        cat, run=run_name, spec=spec, notify=notify, verify=lambda _ck: True,
        gpu_check_s=0.2, gpus=lambda: nvml.read_devices(_nvml(4, {2})),
    )  # fmt: skip
    assert sick.kind == "gpu" and sick.sick_gpus == (2,) and sick.gpus == (0, 1, 2, 3), sick
    incident = detect.record_failure(cat, outcome=sick, notify=notify)
    assert incidents.get_incident(cat, incident).details["sick_gpus"] == [2]

    rebuilt = rebuild_environment(cat, run=run_name, incident_id=incident, notify=notify)
    assert rebuilt.handoff["exclude_gpus"] == [2] and "leaving out sick GPU(s) 2" in rebuilt.decision
    back = detect.supervise(
        cat, run=run_name, spec=JobSpec.from_dict(dict(rebuilt.spec)), notify=notify, verify=lambda _ck: True,
        handoff=rebuilt.handoff, gpu_check_s=0.2, gpus=lambda: nvml.read_devices(_nvml(4, {2})),
    )  # fmt: skip
    assert back.kind == "finished", back  # GPU 2 is still sick, but out of the job's sight: no new stop
    printed = (Path(str(back.log_dir)) / "node-0.log").read_text().split()
    assert printed == ["visible", "0,1,3"], printed


@pytest.mark.timeout(120)
def test_a_sick_gpu_the_job_cannot_see_does_not_stop_it(rewind_env, run_name):
    """A job given GPUs 0 and 1 (its own CUDA_VISIBLE_DEVICES) is not stopped for GPU 3."""
    cat = Catalog()
    spec = JobSpec(
        command=(sys.executable, "-c", "import time; time.sleep(1.5)"), env={"CUDA_VISIBLE_DEVICES": "0,1"}
    )
    ended = detect.supervise(
        cat, run=run_name, spec=spec, notify=LogNotifier(), verify=lambda _ck: True,
        gpu_check_s=0.2, gpus=lambda: nvml.read_devices(_nvml(4, {3})),
    )  # fmt: skip
    assert ended.kind == "finished" and ended.sick_gpus == (), ended


@pytest.mark.timeout(180)
def test_an_xid_stops_the_job_at_once_and_the_relaunch_leaves_that_gpu_out(
    rewind_env, run_name, monkeypatch, tmp_path
):
    """GPU 1 of 2 falls off the bus (Xid 79, through NVML's stand-in: REWIND_NVML_STANDIN): the supervisor
    hears it from the event watch, long before its next health poll (every 30 s here), stops the job, and
    the relaunch sees GPU 0 only. An Xid a program causes itself (13) stops nothing."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    standin = tmp_path / "nvml.json"
    standin.write_text(json.dumps({"gpus": [{"name": "NVIDIA H200"}, {"name": "NVIDIA H200"}], "xids": []}))
    monkeypatch.setenv(nvml.STANDIN_ENV, str(standin))
    cat, notify = Catalog(), LogNotifier()
    spec = JobSpec(command=(sys.executable, "-c", JOB))
    jobs.set_spec(cat, run_name, spec.as_dict())

    def inject() -> None:
        wait_until(lambda: jobs.launches(cat, run_name) or None, 60, "the launch")
        for x in ({"gpu": 0, "xid": 13}, {"gpu": 1, "xid": 79}):
            data = json.loads(standin.read_text())
            (tmp_path / "next.json").write_text(json.dumps({**data, "xids": [*data["xids"], x]}))
            os.replace(tmp_path / "next.json", standin)  # whole, as a driver's report would be
            injected.append(time.time())

    injected: list[float] = []
    threading.Thread(target=inject, daemon=True).start()
    sick = detect.supervise(
        cat, run=run_name, spec=spec, notify=notify, verify=lambda _ck: True, gpu_check_s=30.0
    )
    assert sick.kind == "gpu" and sick.sick_gpus == (1,) and sick.gpus == (0, 1), sick
    assert sick.died_at - injected[-1] < 5, (sick.died_at, injected)  # the event, not the 30 s poll
    assert "Xid 79 on GPU 1 (fallen off the bus)" in str(sick.anomaly), sick.anomaly
    incident = detect.record_failure(cat, outcome=sick, notify=notify)
    rebuilt = rebuild_environment(cat, run=run_name, incident_id=incident, notify=notify)
    back = detect.supervise(
        cat, run=run_name, spec=JobSpec.from_dict(dict(rebuilt.spec)), notify=notify, verify=lambda _ck: True,
        handoff=rebuilt.handoff, gpu_check_s=30.0,
    )  # fmt: skip
    assert back.kind == "finished", back
    assert (Path(str(back.log_dir)) / "node-0.log").read_text().split() == ["visible", "0"]
