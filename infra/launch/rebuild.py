"""How a failed job comes back: its size for the devices left, and what it is told about batch and rate.

A pure function of the run's spec (as written, full size), the launch that
failed (its actual size) and the failure. A crash or a sick GPU costs the job
its devices: a lost node's agent takes the node (one node fewer), any other
crash one rank per node fewer, never below ``min_world_size``; a sick GPU is left out by its index
(the relaunch sees only the others), and a machine with no healthy GPU left is not relaunched onto. The layout
planner picks TP x PP x DP for what is left, from the layout the restore point was saved with (its
session reported it, with the model's shape) or the failed launch was handed; keeping the old TP may
leave a device idle. Without a model shape TP and PP are kept or set to 1, as the decision says.
Learning-rate scale and global batch are relative to the spec's full size, so successive shrinks
compound right.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rewind.infra.errors import Refused
from rewind.infra.health import layout
from rewind.infra.launch.spec import JobSpec, first_layout

SHRINKS = ("crash", "gpu")  # failures that cost devices; a hang or a NaN does not


@dataclass(frozen=True, slots=True, kw_only=True)
class Hosts:
    """What the scheduler offers a relaunch: the failed launch's hosts, those lost, and how many are usable;
    and what the catalog knows: the hosts whose own disks hold a copy of the restore point."""

    previous: tuple[str, ...]
    lost: tuple[str, ...]
    usable: int  # hosts up now, the lost ones left out
    holding: tuple[str, ...] = ()  # hosts whose own disks hold a verified (or committed) copy of it

    def preferred(self) -> list[str]:
        """The hosts a relaunch asks for first: those holding the restore point on their own disks (the
        failed launch's first, in its order: node 0 keeps the rendezvous on a surviving host), then the
        rest of the failed launch's survivors; never a lost one."""
        up = [h for h in dict.fromkeys([*self.previous, *self.holding]) if h not in self.lost]
        return [h for h in up if h in self.holding] + [h for h in up if h not in self.holding]


@dataclass(frozen=True, slots=True)
class Relaunch:
    spec: JobSpec  # what to start now
    handoff: dict[str, Any]  # what the job is told: world_size, lr_scale, global_batch, decision
    decision: str
    before: layout.Layout
    after: layout.Layout


def _smaller(current: JobSpec, lost_node: int | None) -> tuple[int, int] | None:
    """(nnodes, nproc_per_node) one step smaller than ``current``, or None if nothing smaller fits."""
    if current.nnodes > 1 and lost_node is not None:
        size = (current.nnodes - 1, current.nproc_per_node)
    elif current.nproc_per_node > 1:
        size = (current.nnodes, current.nproc_per_node - 1)
    else:
        return None
    return size if size[0] * size[1] >= current.min_world_size else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Devices:
    """The GPUs of the failed launch's machine: every one NVML saw, those found sick now, those left out
    already (earlier relaunches)."""

    every: tuple[int, ...]
    sick: tuple[int, ...]
    excluded: tuple[int, ...] = ()

    @property
    def left_out(self) -> tuple[int, ...]:
        return tuple(sorted({*self.excluded, *self.sick}))

    @property
    def healthy(self) -> int:
        return len([i for i in self.every if i not in self.left_out])


def _without_sick(current: JobSpec, devices: Devices) -> tuple[int, int] | None:
    """(nnodes, nproc_per_node) on the healthy GPUs left: the sick ones are left out, not the last local rank."""
    if devices.healthy == 0:
        raise Refused(
            f"every GPU of this machine is sick or left out ({', '.join(map(str, devices.left_out))}): "
            "not relaunching onto them; replace the GPU or move the job"
        )
    nproc = min(current.nproc_per_node, devices.healthy)
    if nproc == current.nproc_per_node:
        return None  # enough healthy devices for the same size
    size = (current.nnodes, nproc)
    if size[0] * size[1] < current.min_world_size:
        raise Refused(
            f"{devices.healthy} healthy GPU(s) left, fewer than the job's min_world_size {current.min_world_size}"
        )
    return size


def known_layout(world: int, *records: layout.Layout | None) -> layout.Layout | None:
    """The first record made for ``world`` devices; else the first whose TP x PP divides ``world`` (its DP the
    rest); None where nothing was recorded."""
    found = [r for r in records if r is not None]
    exact = [r for r in found if r.world_size == world]
    fits = [layout.Layout(r.tp, r.pp, world // (r.tp * r.pp)) for r in found if not world % (r.tp * r.pp)]
    return next(iter(exact + fits), None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """What the run's records say of its layout: as its restore point saved it (the job's session
    reported it), as the failed launch was handed it, and the model's shape (the checkpoint's, else the
    spec's)."""

    saved: layout.Layout | None = None
    handed: layout.Layout | None = None
    shape: layout.ModelShape | None = None
    same_world: bool = False  # the job's loader keeps per-rank state: restorable by as many ranks only


def _layouts(full: JobSpec, current: JobSpec, rec: Recorded) -> tuple[layout.Layout, layout.Layout]:
    """The layout the failed launch ran, and the run's full-size one (what batch and rate are relative
    to); data-parallel where nothing recorded a layout."""
    first = first_layout(full)
    before = known_layout(current.world_size, rec.saved, rec.handed, first)
    before = before or layout.Layout(tp=1, pp=1, dp=current.world_size)
    base = known_layout(full.world_size, first, before) or layout.Layout(tp=1, pp=1, dp=full.world_size)
    return before, base


def _choose(
    full: JobSpec, current: JobSpec, nnodes: int, nproc: int, rec: Recorded
) -> tuple[layout.Layout, layout.Plan]:
    """The planner's choice on at most ``nnodes`` x ``nproc`` devices (whole nodes, fewer ranks per node
    where keeping the TP needs it, never below ``min_world_size`` where anything else fits)."""
    before, base = _layouts(full, current, rec)
    sizes = [nnodes * p for p in range(1, nproc + 1)]
    sizes = [n for n in sizes if n >= current.min_world_size] or sizes
    chosen = layout.plan(
        nnodes * nproc, rec.shape or layout.ModelShape.from_dict(full.model), before,
        global_batch=full.global_batch, lr=full.lr, sizes=sizes, base=base,
    )  # fmt: skip
    return before, chosen


def plan(
    full: JobSpec,
    current: JobSpec,
    kind: str,
    *,
    lost_node: int | None,
    shrink: bool,
    hosts: Hosts | None = None,
    devices: Devices | None = None,
    recorded: Recorded | None = None,
) -> Relaunch:
    """The relaunch after a failure of ``kind`` of the launch that ran ``current``; with ``hosts``, a lost
    host is left out and replaced by a spare where the scheduler has one (then nothing shrinks); with
    ``devices`` after a sick GPU, that GPU is left out (``exclude_gpus`` in the handoff) and the job runs
    on the healthy ones. The layout is planned from ``recorded`` (the restore point's, the failed launch's)."""
    rec = recorded or Recorded()
    spare = hosts is not None and lost_node is not None and hosts.usable >= current.nnodes
    if kind == "gpu" and devices is not None and devices.every:
        size = _without_sick(current, devices) if shrink else None
    else:
        size = _smaller(current, lost_node) if shrink and kind in SHRINKS and not spare else None
    if rec.same_world and size is not None and kind != "gpu":
        size = None  # a smaller world could not restore the loader's per-rank state
        current = replace(current, min_world_size=current.world_size)
    nnodes, nproc = size or (current.nnodes, current.nproc_per_node)
    before, chosen = _choose(full, current, nnodes, nproc, rec)
    after = chosen.layout
    nproc = after.world_size // nnodes
    changed = size is not None or after != before
    what = (
        f"relaunch on {after.world_size} ranks ({nnodes} node(s) x {nproc}) as {after}, resharded from the "
        "newest verified checkpoint"
        if changed
        else "restart with the same layout; resume from the newest verified checkpoint"
    )
    what += _placement_note(hosts, spare, kind, devices)
    if rec.same_world and not changed:
        what += " (the job's loader keeps per-rank state: the same number of ranks)"
    note = "" if rec.shape or full.model else " (no model shape reported: TP and PP kept or 1)"
    decision = f"{what}: {chosen.reason}{note}" if changed else what
    handoff: dict[str, Any] = {
        "world_size": after.world_size,
        "layout": after.as_dict(),
        "lr_scale": chosen.scale,
        "global_batch": chosen.global_batch,
        "lr": chosen.lr,
        "spike_factor": full.loss_spike_factor,
        "decision": decision,
    }
    if devices is not None and devices.every and devices.left_out:  # kept across later relaunches too
        handoff["gpus"], handoff["exclude_gpus"] = list(devices.every), list(devices.left_out)
    if hosts is not None:
        handoff["exclude_hosts"] = list(hosts.lost)
        handoff["prefer_hosts"] = hosts.preferred()
    return Relaunch(
        current.resized(nnodes=nnodes, nproc_per_node=nproc, layout=after), handoff, decision, before, after
    )


def _placement_note(hosts: Hosts | None, spare: bool, kind: str, devices: Devices | None) -> str:
    what = ""
    if hosts is not None and hosts.lost:
        what += f"; leaving out lost host(s) {', '.join(hosts.lost)}" + (" for a spare" if spare else "")
    holding = [h for h in hosts.preferred() if h in hosts.holding] if hosts is not None else []
    if holding:
        what += f"; preferring host(s) {', '.join(holding)}, whose own disks hold the restore point"
    if kind == "gpu" and devices is not None and devices.every:
        what += f"; leaving out sick GPU(s) {', '.join(map(str, devices.left_out))}"
    return what
