"""Launching a run from its spec and watching it: ``poll()`` returns what happened, as typed observations.

The supervisor starts one process (a single-process job) or one torchrun agent
per node (each in its own process group, so a node can be stopped whole), and
records the launch in the catalog with what the job is handed. It watches
exits, the ranks' progress rows (a rank whose step stops advancing longer than
the hang timeout is hung; an anomaly a rank recorded), newly committed
checkpoints and, where a driver exists, GPU health. It never reads the job's
output for meaning: the tail it keeps is for the incident report only.
"""

from __future__ import annotations

import collections
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from infra.catalog import jobs, lineage
from infra.catalog.db import Catalog
from infra.catalog.models import CheckpointStatus
from infra.health import nvml
from infra.health.signals import describe_exit
from infra.launch.process import stop_group
from infra.launch.spec import JobSpec, agent_command, process_command
from infra.net import free_port
from infra.training import progress


class Seen(StrEnum):
    FIRST_STEP = "first_step"  # a rank got past the step it started from
    COMMITTED = "committed"  # a checkpoint was committed
    ANOMALY = "anomaly"  # a rank recorded NaN/Inf or a loss spike
    HANG = "hang"  # a rank made no progress for longer than the timeout
    GPU = "gpu"  # NVML says a GPU is unhealthy
    EXITED = "exited"  # a process (or a node's agent) ended


@dataclass(frozen=True, slots=True)
class Observation:
    kind: Seen
    at: float
    step: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class _Process:
    """One child process in its own session, its output's tail kept for the incident."""

    def __init__(self, cmd: list[str], *, cwd: str | None, env: dict[str, str], node: int) -> None:
        self.node, self.cmd = node, cmd
        self.ended_at: float | None = None  # when it ended, by this clock: which node failed first
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True, name=f"rewind-out-{self.proc.pid}").start()
        threading.Thread(target=self._wait, daemon=True, name=f"rewind-wait-{self.proc.pid}").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # children that outlive it may keep the pipe open: not our clock
            self.tail.append(line.rstrip("\n"))

    def _wait(self) -> None:
        self.proc.wait()
        self.ended_at = time.time()

    def stop(self, timeout_s: float) -> None:
        stop_group(self.proc.pid, timeout_s=timeout_s)

    def ended(self) -> int | None:
        """The exit code once the process has ended, else None."""
        return self.proc.returncode if self.ended_at is not None else None


class Supervisor:
    """One launch of a run: ``start()``, then ``poll()`` until an ``EXITED`` observation, then ``stop()``."""

    def __init__(
        self,
        cat: Catalog,
        run: str,
        spec: JobSpec,
        *,
        handoff: dict[str, Any] | None = None,
        incident_id: int | None = None,
        gpu_check_s: float | None = 30.0,
    ) -> None:
        self.cat, self.run, self.spec = cat, run, spec
        self.handoff = {
            "world_size": spec.world_size,
            "lr_scale": 1.0,
            "global_batch": spec.global_batch,
            "spike_factor": spec.loss_spike_factor,
            **(handoff or {}),
        }
        self.incident_id, self.gpu_check_s = incident_id, gpu_check_s
        self.launch_id: int | None = None
        self.processes: list[_Process] = []
        self.started_at = 0.0
        self._seen_ckpts: set[int] = set()
        self._first_step = False
        self._next_gpu = 0.0
        self._start_step: int | None = None

    # -- starting ------------------------------------------------------------------------

    def start(self) -> int:
        run_id = lineage.ensure_run(self.cat, self.run)
        self._seen_ckpts = {c.id for c in lineage.restorable(self.cat, run_id)}
        self.launch_id = jobs.begin_launch(
            self.cat, self.run, self.spec.as_dict(), self.handoff, incident_id=self.incident_id
        )
        self.started_at = time.time()
        self._next_gpu = time.monotonic() + (self.gpu_check_s or 0)
        base = {**os.environ, **self.spec.env, **self._handoff_env()}
        if not self.spec.distributed:
            self.processes = [_Process(process_command(self.spec), cwd=self.spec.cwd, env=base, node=0)]
            return self.launch_id
        endpoint = self.spec.rdzv_endpoint or f"127.0.0.1:{free_port()}"
        cmd = agent_command(self.spec, endpoint=endpoint, rdzv_id=f"{self.run}-{self.launch_id}")
        node_env = (lambda i: {progress.NODE_ENV: str(i)}) if self.spec.nnodes > 1 else (lambda i: {})
        self.processes = [
            _Process(cmd, cwd=self.spec.cwd, env={**base, **node_env(i)}, node=i)
            for i in range(self.spec.nnodes)
        ]
        return self.launch_id

    def _handoff_env(self) -> dict[str, str]:
        """For jobs that do not use the session object: the same facts as documented variables."""
        h = self.handoff
        env = {progress.LAUNCH_ENV: str(self.launch_id), "REWIND_LR_SCALE": repr(float(h["lr_scale"]))}
        if h.get("global_batch") is not None:
            env["REWIND_GLOBAL_BATCH"] = str(h["global_batch"])
        return env

    # -- watching ------------------------------------------------------------------------

    def poll(self, timeout_s: float = 1.0) -> list[Observation]:
        """Wait up to ``timeout_s`` for something to happen; every observation since the last poll."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not any(p.ended() is not None for p in self.processes):
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        now = time.time()
        seen = self._committed(now) + self._progress(now) + self._gpu(now)
        seen += [
            Observation(
                Seen.EXITED,
                p.ended_at or now,
                detail={"node": p.node, "exit_code": code, "how": describe_exit(code)},
            )
            for p in self.processes
            if (code := p.ended()) is not None
        ]
        return seen

    def _committed(self, now: float) -> list[Observation]:
        out = []
        for ck in lineage.restorable(self.cat, lineage.get_run(self.cat, self.run).id):
            if ck.id not in self._seen_ckpts and ck.status == CheckpointStatus.COMMITTED:
                self._seen_ckpts.add(ck.id)
                out.append(Observation(Seen.COMMITTED, now, ck.step, {"checkpoint_id": ck.id}))
        return out

    def _progress(self, now: float) -> list[Observation]:
        assert self.launch_id is not None
        ranks = progress.read(self.cat, self.launch_id)
        out: list[Observation] = []
        if self._start_step is None and ranks:
            self._start_step = min((r.step or 0) for r in ranks)
        if not self._first_step and any((r.step or 0) > (self._start_step or 0) for r in ranks):
            self._first_step = True
            first = max(r.step or 0 for r in ranks)
            out.append(Observation(Seen.FIRST_STEP, now, first, {"from_step": self._start_step}))
        anomalies = sorted(
            (r for r in ranks if "anomaly" in r.detail), key=lambda r: r.detail["anomaly"]["step"]
        )
        if anomalies:  # the earliest: later ones on other ranks are its consequences
            a = anomalies[0].detail["anomaly"]
            out.append(Observation(Seen.ANOMALY, now, a.get("step"), {**a, "rank": anomalies[0].rank}))
        timeout = self.spec.heartbeat_timeout_s
        hung = [r for r in ranks if timeout and r.state == "running" and r.silent_for(now) > timeout]
        if hung:
            reason = "; ".join(
                f"rank {r.rank} on {r.node} made no progress for {r.silent_for(now):.1f}s (timeout {timeout:g}s) "
                f"after step {r.step}"
                for r in hung
            )
            detail = {"ranks": [r.rank for r in hung], "silent_s": max(r.silent_for(now) for r in hung),
                      "timeout_s": timeout, "reason": reason}  # fmt: skip
            out.append(Observation(Seen.HANG, now, min(r.step or 0 for r in hung), detail))
        return out

    def _gpu(self, now: float) -> list[Observation]:
        if not self.gpu_check_s or time.monotonic() < self._next_gpu:
            return []
        self._next_gpu = time.monotonic() + self.gpu_check_s
        try:
            sick = [g for g in nvml.probe() if not g.healthy]
        except nvml.NoNvidiaDriver:
            self.gpu_check_s = None  # no driver here: GPU health is not monitored
            return []
        if not sick:
            return []
        why = "; ".join(f"GPU {g.index} ({g.name}): {', '.join(g.problems)}" for g in sick)
        return [Observation(Seen.GPU, now, None, {"reason": why})]

    # -- ending --------------------------------------------------------------------------

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop every process group that is still running (SIGTERM, then SIGKILL after ``timeout_s``)."""
        for p in self.processes:
            if p.ended() is None:
                p.stop(timeout_s)

    def finish(self) -> int:
        """Once everything has ended: the launch's exit code (the first failure's), recorded on the launch."""
        for p in self.processes:
            if p.ended() is None:
                p.proc.wait()
        codes = [p.ended() or 0 for p in self.processes]
        code = next((c for c in codes if c != 0), 0)
        if self.launch_id is not None:
            jobs.end_launch(self.cat, self.launch_id, code)
        return code

    def tail(self) -> list[str]:
        return [line for p in self.processes for line in list(p.tail)[-40:]]


def first_failure(observations: list[Observation]) -> Observation | None:
    """The exit that ended the launch (a lost node's agent), else None.

    A process killed by a signal is the cause rather than the consequence (the others
    fail because their peers vanished); among equals, the one that ended first.
    """
    failed = [o for o in observations if o.kind is Seen.EXITED and o.detail["exit_code"] != 0]
    return min(failed, key=lambda o: (o.detail["exit_code"] > 0, o.at)) if failed else None
