"""Launching a run from its spec and watching it: ``poll()`` returns what happened, as typed observations.

The supervisor starts one process (a single-process job) or one torchrun agent
per node, and records the launch in the catalog with what the job is handed. It
watches exits, the ranks' progress rows (``rewind.infra.launch.observe`` judges hangs
and anomalies), newly committed checkpoints and, where a driver exists, GPU
health. It never reads the job's output for meaning: the tail it keeps is for the
incident report only, and the whole output is kept per node (``joblog``). Every process of a launch (torchrun's workers run in
sessions of their own) carries ``REWIND_LAUNCH_ID`` and ``REWIND_NODE``: that is
how a node, or the whole launch, is stopped, workers included.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rewind.infra import joblog
from rewind.infra.catalog import jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus
from rewind.infra.errors import CatalogUnavailable, ConfigError, RewindError, TransientError
from rewind.infra.health import nvml
from rewind.infra.health.layout import ENV as LAYOUT_ENV
from rewind.infra.health.layout import Layout
from rewind.infra.health.signals import describe_exit
from rewind.infra.launch import observe, warm, workdir
from rewind.infra.launch.gpu_watch import GpuWatch
from rewind.infra.launch.host_watch import HostWatch
from rewind.infra.launch.launchers import LauncherKind, Placement, Request, launcher_for
from rewind.infra.launch.memory_agent import MemoryAgent
from rewind.infra.launch.node_process import NodeProcess, bounded_tail
from rewind.infra.launch.observe import Observation, Seen, first_failure
from rewind.infra.launch.process import pids_with_env, signal_all
from rewind.infra.launch.spec import JobSpec, agent_command, first_layout, process_command, redacted
from rewind.infra.training import progress

log = logging.getLogger("rewind.supervisor")
BUSY_FACTOR = 10  # a busy phase (restore, start-up, save) may take this many hang timeouts
MIN_BUSY_S = 300.0


PLACEMENT_FAILED = 125  # the exit code recorded on a launch whose nodes were never granted
# the exit code recorded on a launch whose command could not be started (a shell's 'not found')
NOT_STARTED = 127


class Supervisor:
    """One launch of a run: ``start()``, then ``poll()`` until every process exited, then ``finish()``."""

    def __init__(
        self,
        cat: Catalog,
        run: str,
        spec: JobSpec,
        *,
        handoff: dict[str, Any] | None = None,
        incident_id: int | None = None,
        gpu_check_s: float | None = 30.0,
        host_check_s: float = 2.0,
        gpus: Callable[[], list[nvml.GpuHealth]] = nvml.probe,
    ) -> None:
        self.cat, self.run, self.spec = cat, run, spec
        self.gpus = gpus  # this machine's GPUs (NVML; tests hand a stand-in)
        self._gpu_watch: GpuWatch | None = None
        self.launcher = launcher_for(spec.launcher)
        self.placement: Placement | None = None
        self.host_watch = HostWatch(self.launcher, host_check_s)
        self.handoff = {
            "world_size": spec.world_size,
            "lr_scale": 1.0,
            "global_batch": spec.global_batch,
            "spike_factor": spec.loss_spike_factor,
            **(handoff or {}),
        }
        if "layout" not in self.handoff and (first := first_layout(spec)) is not None:
            self.handoff["layout"] = first.as_dict()
        self.incident_id, self.gpu_check_s = incident_id, gpu_check_s
        self.launch_id: int | None = None
        self.token = uuid.uuid4().hex  # what the launch's processes are found by (ids repeat across catalogs)
        self.handoff["token"] = self.token
        self.processes: list[NodeProcess] = []
        self.started_at = 0.0
        self._seen_ckpts: set[int] = set()
        self._first_step = False
        self._standbys: list[tuple[str, int, list[str], str | None, dict[str, str], bool]] = []
        self.ranks: list[progress.RankState] = []  # the ranks' rows as last read, for whoever shows progress
        self._memory: MemoryAgent | None = None  # this node's memory agent (a job on this machine only)
        self._ended = 0

    # -- starting ------------------------------------------------------------------------

    def start(self) -> int:
        workdir.ready(self.run, self.spec.cwd)
        if self.spec.cwd and not os.path.isdir(self.spec.cwd):  # before a launch is recorded or started
            raise ConfigError(f"the job's working directory {self.spec.cwd} does not exist (cwd in its spec)")
        joblog.max_bytes()  # a bad REWIND_JOB_LOG_MAX_MB is refused before anything is recorded
        run_id = lineage.ensure_run(self.cat, self.run)
        self._seen_ckpts = {c.id for c in lineage.restorable(self.cat, run_id)}
        joblog.prune(self.run, joblog.KEEP_LAUNCHES - 1)  # room for this launch's output
        self.launch_id = jobs.begin_launch(
            self.cat, self.run, redacted(self.spec), self.handoff, incident_id=self.incident_id
        )
        self.started_at = time.time()
        place = self._place()
        base = {**os.environ, **self.spec.env, **self._handoff_env()}
        base.update(self._device_env(base))
        self._gpu_watch = GpuWatch(self.gpus, self.gpu_check_s, self._excluded_gpus())
        self._gpu_watch.launch_sees(base.get("CUDA_VISIBLE_DEVICES"))  # only these GPUs' health stops it
        if self.spec.distributed:
            cmd = agent_command(self.spec, endpoint=place.endpoint, rdzv_id=f"{self.run}-{self.launch_id}")
        else:
            cmd = process_command(self.spec)
        if self.launcher.kind is LauncherKind.LOCAL:  # before the job: it holds what the job commits
            # not the launch's environment: the agent is not one of the job's processes, found by its token
            self._memory = MemoryAgent.start(self.run, {**os.environ, **self.spec.env})
        self._start_nodes(place, cmd, base)
        if (
            self.spec.warm
        ):  # the next launch's standbys, made once this one trains (not competing with its start)
            try:
                jobs.set_warm(self.cat, self.launch_id, [p.warm for p in self.processes])
            except RewindError as exc:  # a record for people: the job runs and is watched all the same
                log.warning(
                    "launch %s: which nodes a standby took over not recorded: %s", self.launch_id, exc
                )
            self._standbys = [
                (self.run, p.node, p.cmd, self.spec.cwd, {**base, progress.NODE_ENV: str(p.node)}, p.warm)
                for p in self.processes
            ]
        return self.launch_id

    def _start_nodes(self, place: Placement, cmd: list[str], base: dict[str, str]) -> None:
        """One process per host; a command that cannot be started (a mistyped program, one not executable)
        ends the launch, and anything of it started, before a one-line ``ConfigError``."""
        for i in range(len(place.hosts)):
            try:
                self.processes.append(self._node(place, i, cmd, base))
            except OSError as exc:  # the launch ends whatever the error; only the command's is bad input
                self._signal(signal.SIGKILL)
                for p in self.processes:
                    p.proc.wait()
                self.host_watch.release()
                if self._gpu_watch is not None:
                    self._gpu_watch.close()
                if self._memory is not None:  # the run's memory copies stay for the next launch
                    self._memory.close(release=False)
                self._end_launch(NOT_STARTED)
                if exc.errno not in (errno.ENOENT, errno.EACCES, errno.ENOEXEC):
                    raise  # out of processes or memory: not the command's fault
                raise ConfigError(
                    f"the job's command cannot be started: {cmd[0]!r}: {exc.strerror or exc}"
                ) from exc

    def _make_standbys(self) -> None:
        for args in self._standbys:
            threading.Thread(
                target=warm.replace_standby, args=args, daemon=True, name="rewind-standby"
            ).start()
        self._standbys = []

    def _node(self, place: Placement, node: int, cmd: list[str], env: dict[str, str]) -> NodeProcess:
        wrapped = self.launcher.node_command(place, node, cmd)
        env = {**env, progress.NODE_ENV: str(node)}
        kept = self.log_dir / f"node-{node}.log" if self.log_dir else None
        return NodeProcess(
            wrapped, cwd=self.spec.cwd, env=env, node=node, host=place.hosts[node], kept=kept,
            warm_run=self.run if self.spec.warm else None,
        )  # fmt: skip

    @property
    def log_dir(self) -> Path | None:
        """Where this launch's output is kept (``joblog``), once the launch is recorded."""
        return None if self.launch_id is None else joblog.launch_dir(self.run, self.launch_id)

    def _place(self) -> Placement:
        """The launch's hosts, from its launcher, recorded on the launch (a refusal ends the launch)."""
        assert self.launch_id is not None
        request = Request(
            run=self.run, launch_id=self.launch_id, nnodes=self.spec.nnodes if self.spec.distributed else 1,
            exclude=frozenset(self.handoff.get("exclude_hosts") or ()),
            prefer=tuple(self.handoff.get("prefer_hosts") or ()), endpoint=self.spec.rdzv_endpoint,
        )  # fmt: skip
        try:
            self.placement = self.host_watch.placement = self.launcher.place(request)
        except BaseException:
            self._end_launch(PLACEMENT_FAILED)
            raise
        jobs.set_placement(
            self.cat, self.launch_id, hosts=list(self.placement.hosts), allocation=self.placement.allocation
        )
        return self.placement

    def _handoff_env(self) -> dict[str, str]:
        """For jobs that do not use the session object: the same facts as documented variables."""
        h = self.handoff
        env = {
            progress.LAUNCH_ENV: str(self.launch_id),
            progress.TOKEN_ENV: self.token,
            "REWIND_LR_SCALE": repr(float(h["lr_scale"])),
            "REWIND_LAUNCHER": str(self.spec.launcher),  # on a scheduler's hosts, each sends its own files on
        }
        if h.get("global_batch") is not None:
            env["REWIND_GLOBAL_BATCH"] = str(h["global_batch"])
        if (given := Layout.from_dict(h.get("layout"))) is not None:
            env[LAYOUT_ENV] = given.env_value()
        return env

    @property
    def lost_hosts(self) -> dict[str, int]:
        """host -> node, as the scheduler reported them lost during this launch."""
        return self.host_watch.lost

    @property
    def lost_at(self) -> dict[str, float]:
        """host -> when the scheduler was first seen calling it lost."""
        return self.host_watch.lost_at

    # -- watching ------------------------------------------------------------------------

    def poll(self, timeout_s: float = 1.0) -> list[Observation]:
        """Wait up to ``timeout_s`` (less if a process ends); every observation since the last poll."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._count_ended() == self._ended:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        self._ended = self._count_ended()
        now = time.time()
        seen: list[Observation] = []
        try:
            seen += self._committed(now) + self._progress(now)
        except TransientError as exc:  # the catalog blinked: look again at the next poll
            log.warning("could not read the catalog this poll: %s", exc)
        seen += (self._gpu_watch.observe(now) if self._gpu_watch else []) + self.host_watch.observe(now)
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

    def _count_ended(self) -> int:
        return sum(p.ended() is not None for p in self.processes)

    def _committed(self, now: float) -> list[Observation]:
        out = []
        for ck in lineage.restorable(self.cat, lineage.get_run(self.cat, self.run).id):
            if ck.id not in self._seen_ckpts and ck.status == CheckpointStatus.COMMITTED:
                self._seen_ckpts.add(ck.id)
                if self._memory is not None:
                    self._memory.offer(ck.id)
                out.append(Observation(Seen.COMMITTED, now, ck.step, {"checkpoint_id": ck.id}))
        return out

    def _progress(self, now: float) -> list[Observation]:
        assert self.launch_id is not None
        ranks = self.ranks = progress.read(self.cat, self.launch_id)
        out = []
        if not self._first_step and (first := observe.first_step(ranks)) is not None:
            self._first_step = True
            out.append(first)
            self._make_standbys()
        hang_s = self.spec.heartbeat_timeout_s
        limits = observe.Limits(
            hang_s=hang_s,
            busy_s=max(MIN_BUSY_S, BUSY_FACTOR * hang_s) if hang_s else MIN_BUSY_S,
            world_size=int(self.handoff["world_size"]),
            started_at=self.started_at,
        )
        for found in (observe.anomaly(ranks), observe.hang(ranks, now, limits)):
            if found is not None:
                out.append(found)
        return out

    def _excluded_gpus(self) -> set[int]:
        return {int(i) for i in self.handoff.get("exclude_gpus") or ()}

    def _device_env(self, base: dict[str, str]) -> dict[str, str]:
        """After a sick GPU: the launch sees only the others (``CUDA_VISIBLE_DEVICES``, in NVML's PCI order),
        out of the devices the job was given (its own ``CUDA_VISIBLE_DEVICES``) or every one."""
        excluded = self._excluded_gpus()
        if not excluded:
            return {}
        given = base.get("CUDA_VISIBLE_DEVICES")
        known = given.split(",") if given else [str(i) for i in self.handoff.get("gpus") or ()]
        left = [d.strip() for d in known if d.strip() and d.strip() not in {str(i) for i in excluded}]
        return {"CUDA_VISIBLE_DEVICES": ",".join(left), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    # -- ending --------------------------------------------------------------------------

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM every process of the launch (workers too), SIGKILL what is left after ``grace_s``."""
        if self._gpu_watch is not None:
            self._gpu_watch.close()
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.ended() is None for p in self.processes):
            self.host_watch.observe(time.time())  # a step on a lost host never ends by itself: do not wait
            if all(p.host in self.lost_hosts for p in self.processes if p.ended() is None):
                break
            time.sleep(0.1)
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.launch_id is None:
            return
        workers = pids_with_env(**{progress.TOKEN_ENV: self.token})
        signal_all([p.proc.pid for p in self.processes if p.ended() is None] + workers, sig)
        for p in self.processes:  # a warm job's processes carry its standby's environment: its session, then
            if p.warm:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.proc.pid, sig)
        if self.placement is not None and self.launcher.kind is not LauncherKind.LOCAL:
            try:  # the ranks on other hosts: through the scheduler
                self.launcher.cancel(self.placement, signal_name="TERM" if sig == signal.SIGTERM else "KILL")
            except TransientError as exc:
                log.warning("could not signal the allocation: %s", exc)

    def finish(self) -> int:
        """Once every process ended: the launch's exit code (the first failure's), recorded on the launch."""
        for p in self.processes:
            p.proc.wait()
            p.joined()
        if self._gpu_watch is not None:
            self._gpu_watch.close()
        exits = [
            Observation(Seen.EXITED, p.ended_at or time.time(), detail={"node": p.node, "exit_code": p.proc.returncode})
            for p in self.processes
        ]  # fmt: skip
        failed = first_failure(exits)
        code = failed.detail["exit_code"] if failed is not None else 0
        if code != 0:
            self.host_watch.settle(len(self.processes))
        if self.spec.warm and (code == 0 or not self._first_step):
            for p in self.processes:  # the run is done, or a launch died before training: a cold start next
                warm.stop(self.run, p.node)
        self.host_watch.release()
        if self._memory is not None:  # a finished run has nothing to come back to; a failed one, its memory
            self._memory.close(release=code == 0)
        if self.launch_id is not None:
            self._end_launch(code)
        return code

    def _end_launch(self, code: int, timeout_s: float = 120.0) -> None:
        """Record the exit, riding out a catalog restart (bounded): the job is over, and losing its
        end would lose the incident too (found by the catalog-restart drill)."""
        deadline, wait = time.monotonic() + timeout_s, 0.5
        while True:
            try:
                jobs.end_launch(self.cat, self.launch_id, code)  # type: ignore[arg-type]
                return
            except CatalogUnavailable as exc:
                if time.monotonic() + wait > deadline:
                    raise
                log.warning("could not record the end of launch %s yet (retrying): %s", self.launch_id, exc)
                time.sleep(wait)
                wait = min(wait * 2, 5.0)

    def tail(self) -> list[str]:
        """The job's last lines of output (stdout and stderr), at most ``TAIL_LINES`` and ``TAIL_BYTES``;
        with several nodes, each line says which node's agent printed it."""
        if len(self.processes) == 1:
            return bounded_tail(list(self.processes[0].tail))
        return bounded_tail([f"[node {p.node}] {line}" for p in self.processes for line in list(p.tail)])
