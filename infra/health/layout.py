"""Choosing a parallel layout (TP x PP x DP) for the devices that are left.

TP must divide the attention heads and the hidden size, PP must divide the
layers, and TP * PP * DP is the devices used. Among the layouts that fit, the
old TP is preferred (it changes the per-device math least), even if that leaves
a device idle; then the most devices used, then the old PP, then the largest DP.
The consequence for batch size and learning rate is spelled out: keeping the
per-device micro-batch shrinks the global batch by DP'/DP, and the linear scaling
rule scales the learning rate by the same factor.

Without a model shape the planner knows only that the old TP and PP fit the
model (and that 1 always does): it chooses among those.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rewind.infra.errors import ConfigError

ENV = "REWIND_LAYOUT"  # what a launch is handed, e.g. "tp=2,pp=1,dp=2"


def _whole(raw: Mapping[str, Any], key: str, what: str) -> int:
    value = raw.get(key)
    if type(value) is not int or value < 1:
        raise ConfigError(f"{what} {key} must be a whole number >= 1, not {value!r:.40}")
    return value


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

    def __str__(self) -> str:
        return f"TP{self.tp} x PP{self.pp} x DP{self.dp}"

    def env_value(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp}"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> Layout | None:
        """The layout a checkpoint or a handoff recorded; None where none was (a data-parallel-only
        record, ``{"world_size": W, "tp": 1, ...}`` from before layouts were reported, is a layout too)."""
        if not raw or not all(k in raw for k in ("tp", "pp", "dp")):
            return None
        return cls(*(_whole(raw, k, "layout") for k in ("tp", "pp", "dp")))

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``tp=2,pp=1,dp=2`` (the form of ``REWIND_LAYOUT``)."""
        try:
            pairs = dict(part.split("=", 1) for part in text.split(","))
            found = cls.from_dict({k.strip(): int(v) for k, v in pairs.items()})
        except ValueError as exc:
            raise ConfigError(f"{ENV} must read like tp=2,pp=1,dp=2, not {text!r:.60}") from exc
        if found is None:
            raise ConfigError(f"{ENV} must give tp, pp and dp, not {text!r:.60}")
        return found


@dataclass(frozen=True, slots=True)
class ModelShape:
    heads: int
    hidden: int
    layers: int

    def as_dict(self) -> dict[str, int]:
        return {"heads": self.heads, "hidden": self.hidden, "layers": self.layers}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> ModelShape | None:
        if not raw:
            return None
        return cls(*(_whole(raw, k, "model shape") for k in ("heads", "hidden", "layers")))


@dataclass(frozen=True, slots=True)
class Plan:
    layout: Layout
    scale: (
        float  # DP' / DP of the full size: what the global batch and (linear scaling) the rate are scaled by
    )
    global_batch: int | None
    lr: float | None
    reason: str


def _fits(tp: int, pp: int, shape: ModelShape | None, old: Layout | None) -> bool:
    if shape is None:  # what is known to fit: the old degrees, and 1
        return tp in (1, old.tp if old else 1) and pp in (1, old.pp if old else 1)
    return not (shape.heads % tp or shape.hidden % tp or shape.layers % pp)


def candidates(devices: int, shape: ModelShape | None, old: Layout | None = None) -> list[Layout]:
    """Every layout that uses exactly ``devices`` devices and fits the model."""
    if devices < 1:
        raise ConfigError("no devices left to run on")
    out = []
    for tp in range(1, devices + 1):
        for pp in range(1, devices // tp + 1):
            if not devices % (tp * pp) and _fits(tp, pp, shape, old):
                out.append(Layout(tp, pp, devices // (tp * pp)))
    return out


def choose(options: list[Layout], old: Layout) -> Layout:
    """The old TP first (even with a device idle), then the most devices, the old PP, the widest DP."""
    return min(options, key=lambda c: (c.tp != old.tp, -c.world_size, c.pp != old.pp, -c.dp))


def plan(
    devices: int,
    shape: ModelShape | None,
    old: Layout,
    *,
    global_batch: int | None,
    lr: float | None,
    sizes: list[int] | None = None,
    base: Layout | None = None,
) -> Plan:
    """The best layout on at most ``devices`` devices (on one of ``sizes``, where only some device counts
    can be launched, e.g. whole nodes' multiples), and what happens to batch size and learning rate.
    ``global_batch`` and ``lr`` (None: not known) are those of ``base`` (the full-size layout; default ``old``)."""
    if devices < 1:
        raise ConfigError("no devices left to run on")
    options = [
        c for n in (sizes or range(1, devices + 1)) if 1 <= n <= devices for c in candidates(n, shape, old)
    ]
    if not options:
        raise ConfigError(f"no TP x PP x DP layout of {devices} devices fits {shape}")
    best = choose(options, old)
    factor = best.dp / (base or old).dp
    new_batch = max(1, round(global_batch * factor)) if global_batch else None
    new_lr = lr * factor if lr else None
    why = [f"{devices} devices left (was {old.world_size})"]
    if best.world_size < devices:
        why.append(f"{best.world_size} of them used")
    why.append("kept TP" if best.tp == old.tp else f"TP {old.tp} -> {best.tp} (old TP does not fit)")
    why.append("kept PP" if best.pp == old.pp else f"PP {old.pp} -> {best.pp}")
    batch = f"global batch {global_batch} -> {new_batch}" if global_batch else f"global batch x{factor:g}"
    rate = f"lr {lr:g} -> {new_lr:g}" if lr and new_lr else f"lr x{factor:g}"
    full = "" if base in (None, old) else " (from the full size's)"
    why.append(f"DP {old.dp} -> {best.dp}: {batch}, {rate}{full} (linear scaling)")
    return Plan(best, factor, new_batch, new_lr, "; ".join(why))
