"""A job spec: how a run's job is started, kept in the catalog so the supervisor can start it again.

Rewind never reads a job's own flags. A single-process job runs ``command`` as
given; a distributed one (more than one process, or ``torchrun=True``) runs the
same command under ``torch.distributed.run``, each rank exec'ing it unchanged
(``rewind.infra.launch.worker``). What changes between
launches (world size, global batch, learning-rate scale, a data window to skip)
reaches the job through the launch's handoff (``rewind.infra.training.session``), never
through rewritten flags.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rewind.infra import redact, yaml_file
from rewind.infra.errors import ConfigError
from rewind.infra.health.layout import Layout
from rewind.infra.launch.launchers import LauncherKind

MAX_NPROC_PER_NODE = 1024  # processes on one node: more than any node's devices or cores
MAX_NNODES = 65536  # hosts in one launch: more than the largest scheduler allocation


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    command: tuple[str, ...]
    """What one process runs, e.g. ``("python", "-m", "mypkg.train", "--config", "c.yaml")``."""
    cwd: str | None = None
    """Working directory of the job (default: the supervisor's)."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to the job's environment."""
    nnodes: int = 1
    """Nodes (one torchrun agent each)."""
    nproc_per_node: int = 1
    """Processes (ranks) per node."""
    min_world_size: int = 1
    """The fewest ranks the job may come back on after it loses some (elastic)."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the c10d rendezvous; default: 127.0.0.1 and a free port, chosen per launch."""
    torchrun: bool | None = None
    """Start under torchrun even with one process (default: only when there is more than one)."""
    global_batch: int | None = None
    """The job's global batch at its full size, for the rebuild decision (reported, not enforced)."""
    lr: float | None = None
    """The job's base learning rate at its full size, for the rebuild decision."""
    model: dict[str, int] | None = None
    """``{"heads", "hidden", "layers"}`` for the layout planner, where the job's session does not report it
    with its checkpoints; without either, a rebuild keeps the old TP and PP or falls back to 1."""
    layout: dict[str, int] | None = None
    """``{"tp", "pp"}`` the first launch is handed (``REWIND_LAYOUT``, ``session.handoff.layout``); DP is the
    rest of the world size. A relaunch is handed the planner's choice instead."""
    heartbeat_timeout_s: float | None = None
    """A rank whose step does not advance for this long is hung (None: hangs are not watched)."""
    loss_spike_factor: float | None = None
    """A loss above this multiple of the running median is an anomaly (None: NaN/Inf only)."""
    launcher: str = "local"
    """Where the nodes run: ``local`` (child processes here) or ``slurm`` (an allocation, one srun per node)."""
    warm: bool = False
    """Relaunch from a standby interpreter that already imported the job's modules (``python -m MODULE`` or
    ``python SCRIPT``, one process, local launcher); otherwise, or when no standby is fit, a cold start."""

    def __post_init__(self) -> None:
        if not self.command or not all(isinstance(a, str) for a in self.command):
            raise ConfigError("a job spec needs a command: a list of strings, one per argument")
        object.__setattr__(self, "command", tuple(self.command))
        if self.cwd == "":  # an empty form field: the worker's own directory, as when it is left out
            object.__setattr__(self, "cwd", None)
        _check_types(self)
        _check_limits(self)
        if self.rdzv_endpoint is not None:
            _check_endpoint(self.rdzv_endpoint)
        if self.launcher not in (LauncherKind.LOCAL, LauncherKind.SLURM):
            raise ConfigError(f"job spec field launcher must be local or slurm, not {self.launcher!r:.40}")
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ConfigError(
                f"nnodes ({self.nnodes}) and nproc_per_node ({self.nproc_per_node}) must be >= 1"
            )
        if self.nproc_per_node > MAX_NPROC_PER_NODE or self.nnodes > MAX_NNODES:
            raise ConfigError(  # a typo must not start a million processes on a node, or ask for as many hosts
                f"nproc_per_node ({self.nproc_per_node}) must be at most {MAX_NPROC_PER_NODE} and nnodes "
                f"({self.nnodes}) at most {MAX_NNODES}"
            )
        if not 1 <= self.min_world_size <= self.world_size:
            raise ConfigError(f"min_world_size {self.min_world_size} must be between 1 and {self.world_size}")
        if self.model is not None and set(self.model) != {"heads", "hidden", "layers"}:
            raise ConfigError("model must give heads, hidden and layers")
        if self.layout is not None:
            _check_layout(self.layout, self.world_size)
        if self.warm and (
            self.distributed or self.launcher != LauncherKind.LOCAL or not _warmable(self.command)
        ):
            raise ConfigError(
                "warm relaunch takes a single-process `python -m MODULE` or `python SCRIPT` job on the local "
                "launcher (no interpreter options)"
            )
        if self.distributed and not _is_python(self.command[0]):
            raise ConfigError(
                f"a distributed job starts under torchrun, so its command must start with Python, not {self.command[0]!r}"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def distributed(self) -> bool:
        return self.torchrun if self.torchrun is not None else self.world_size > 1

    def resized(self, *, nnodes: int, nproc_per_node: int, layout: Layout | None = None) -> JobSpec:
        """The same job on another size; its layout the one given, else its own where that still fits."""
        world = nnodes * nproc_per_node
        kept = self.layout if self.layout and not world % (self.layout["tp"] * self.layout["pp"]) else None
        return replace(
            self,
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            min_world_size=min(self.min_world_size, world),
            torchrun=self.distributed,  # a job checkpointed by ranks stays under torchrun, even on one
            layout={"tp": layout.tp, "pp": layout.pp} if layout else kept,
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["command"] = list(self.command)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown job spec field(s): {sorted(unknown)}")
        command = data.get("command") or ()
        if not isinstance(command, list | tuple):  # a string would become one argument per character
            raise ConfigError("a job spec needs a command: a list of strings, one per argument")
        try:
            return cls(**{**data, "command": tuple(command)})
        except TypeError as exc:
            raise ConfigError(f"bad job spec: {exc}") from exc


_INT, _NUMBER = (int,), (int, float)
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "cwd": ((str,), "a path"),
    "nnodes": (_INT, "a whole number"),
    "nproc_per_node": (_INT, "a whole number"),
    "min_world_size": (_INT, "a whole number"),
    "rdzv_endpoint": ((str,), "host:port"),
    "torchrun": ((bool,), "true or false"),
    "global_batch": (_INT, "a whole number"),
    "lr": (_NUMBER, "a number"),
    "heartbeat_timeout_s": (_NUMBER, "a number of seconds"),
    "loss_spike_factor": (_NUMBER, "a number"),
    "launcher": ((str,), "local or slurm"),
    "warm": ((bool,), "true or false"),
}


def _check_types(spec: JobSpec) -> None:
    """Every field of the type it must have (YAML gives ``"2"`` or ``yes`` as readily as ``2``), said in one line."""
    for name, (types, what) in _TYPES.items():
        value = getattr(spec, name)
        is_bool = isinstance(value, bool) and bool not in types  # True is an int to Python, not to a user
        if value is not None and (is_bool or not isinstance(value, types)):
            raise ConfigError(f"job spec field {name} must be {what}, not {value!r:.60}")
    if not isinstance(spec.env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in spec.env.items()
    ):
        raise ConfigError('job spec field env must map names to strings (quote values: A: "1")')
    if spec.model is not None and (
        not isinstance(spec.model, dict) or not all(type(v) is int for v in spec.model.values())
    ):
        raise ConfigError("job spec field model must give heads, hidden and layers as whole numbers")


def _check_limits(spec: JobSpec) -> None:
    """Numbers that would make the watch act on a healthy job: a heartbeat timeout of 0 declares it hung at
    the first look, a spike factor of at most 1 calls an ordinary step a spike (each an incident recovered)."""
    limits = (
        ("heartbeat_timeout_s", spec.heartbeat_timeout_s, 0.0, "above 0 seconds (leave it empty for none)"),
        ("loss_spike_factor", spec.loss_spike_factor, 1.0, "above 1 (leave it empty for the default)"),
        ("lr", spec.lr, 0.0, "above 0"),
        ("global_batch", spec.global_batch, 0, "at least 1"),
    )
    for name, value, above, what in limits:
        if value is not None and not (math.isfinite(value) and value > above):
            raise ConfigError(f"job spec field {name} must be {what}, not {value!r:.40}")


def _check_layout(layout: Any, world: int) -> None:
    if (
        not isinstance(layout, dict)
        or set(layout) != {"tp", "pp"}
        or not all(type(v) is int and v >= 1 for v in layout.values())
    ):
        raise ConfigError("job spec field layout must give tp and pp as whole numbers >= 1")
    if world % (layout["tp"] * layout["pp"]):
        raise ConfigError(
            f"layout tp x pp ({layout['tp']} x {layout['pp']}) must divide the world size {world}"
        )


def first_layout(spec: JobSpec) -> Layout | None:
    """The layout the spec's first launch is handed: its TP and PP, DP the rest of the world size."""
    if spec.layout is None:
        return None
    tp, pp = spec.layout["tp"], spec.layout["pp"]
    return Layout(tp=tp, pp=pp, dp=spec.world_size // (tp * pp))


def _check_endpoint(endpoint: str) -> None:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"rdzv_endpoint must be host:port with a port from 1 to 65535, not {endpoint!r:.60}"
        )


def load_file(path: str | os.PathLike[str]) -> JobSpec:
    """A job spec from a JSON or YAML file holding the fields above (``command`` a list of strings);
    a relative ``cwd`` is taken from the file's directory."""
    from pathlib import Path

    p = Path(path)
    raw = yaml_file.read(p, "job spec")
    if not isinstance(raw, dict):
        raise ConfigError(f"job spec {p}: expected a mapping of job spec fields, with a command")
    if raw.get("cwd") and not Path(str(raw["cwd"])).is_absolute():
        raw["cwd"] = str((p.resolve().parent / str(raw["cwd"])).resolve())
    if raw.get("cwd") and not Path(str(raw["cwd"])).is_dir():
        raise ConfigError(f"job spec {p}: its cwd {raw['cwd']} is not a directory")
    return JobSpec.from_dict(raw)


def _warmable(command: tuple[str, ...]) -> bool:
    from rewind.infra.launch.standby import entry_of

    return entry_of(command) is not None


def _is_python(program: str) -> bool:
    name = os.path.basename(program)
    return program == sys.executable or name.startswith("python")


def agent_command(spec: JobSpec, *, endpoint: str, rdzv_id: str) -> list[str]:
    """The command of one node's torchrun agent (the same on every node: c10d assigns node ranks).

    The job's command goes through ``rewind.infra.launch.worker`` after a ``--``, out of
    reach of torchrun's own option parser.
    """
    job = process_command(spec)
    return [
        job[0],
        "-m",
        "torch.distributed.run",
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        "--max-restarts=0",
        "-m",
        "rewind.infra.launch.worker",
        "--",
        *job,
    ]


def process_command(spec: JobSpec) -> list[str]:
    """The command of a single-process job, with a bare ``python`` meaning this interpreter."""
    python, *rest = spec.command
    return [sys.executable if python in ("python", "python3") else python, *rest]


def redacted(spec: JobSpec) -> dict[str, Any]:
    """The spec as recorded on launches and incidents: environment values are secrets until proven not,
    and so are secret-looking flags (the run's own ``job_spec`` keeps them: it must relaunch the job)."""
    out = spec.as_dict()
    out["env"] = dict.fromkeys(spec.env, redact.HIDDEN)
    out["command"] = redact.argv(spec.command)
    return out
