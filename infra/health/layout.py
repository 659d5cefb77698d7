"""Choosing a parallel layout (TP x PP x DP) for the devices that are left.

TP must divide the attention heads and the hidden size, PP must divide the
layers, and TP * PP * DP must use every device. Among the layouts that fit, the
old TP is preferred (it changes the per-device math least), then the old PP,
then the largest DP. The consequence for batch size and learning rate is spelled
out: keeping the per-device micro-batch shrinks the global batch by DP'/DP, and
the linear scaling rule scales the learning rate by the same factor.
"""

from __future__ import annotations

from dataclasses import dataclass

from rewind.infra.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Layout:
    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def as_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "dp": self.dp}


@dataclass(frozen=True, slots=True)
class ModelShape:
    heads: int
    hidden: int
    layers: int


@dataclass(frozen=True, slots=True)
class Plan:
    layout: Layout
    global_batch: int
    lr: float
    reason: str


def candidates(devices: int, shape: ModelShape) -> list[Layout]:
    if devices < 1:
        raise ConfigError("no devices left to run on")
    out = []
    for tp in range(1, devices + 1):
        if devices % tp or shape.heads % tp or shape.hidden % tp:
            continue
        for pp in range(1, devices // tp + 1):
            if (devices // tp) % pp or shape.layers % pp:
                continue
            out.append(Layout(tp, pp, devices // (tp * pp)))
    return out


def plan(devices: int, shape: ModelShape, old: Layout, *, global_batch: int, lr: float) -> Plan:
    """The best layout for ``devices``, and what happens to batch size and learning rate."""
    options = candidates(devices, shape)
    if not options:
        raise ConfigError(f"no TP x PP x DP layout of {devices} devices fits {shape}")
    best = min(options, key=lambda c: (c.tp != old.tp, c.pp != old.pp, -c.dp))
    factor = best.dp / old.dp
    new_batch = max(1, round(global_batch * factor))
    why = [f"{devices} devices left (was {old.world_size})"]
    why.append("kept TP" if best.tp == old.tp else f"TP {old.tp} -> {best.tp} (old TP does not fit)")
    why.append("kept PP" if best.pp == old.pp else f"PP {old.pp} -> {best.pp}")
    why.append(
        f"DP {old.dp} -> {best.dp}: global batch {global_batch} -> {new_batch}, lr {lr:g} -> {lr * factor:g} (linear scaling)"
    )
    return Plan(best, new_batch, lr * factor, "; ".join(why))
