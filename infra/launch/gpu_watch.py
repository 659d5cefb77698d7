"""The supervisor's eye on this machine's GPUs: NVML's health every ``check_s``, and Xid errors the moment
the driver reports them. Only the GPUs the launch can use stop it (its ``CUDA_VISIBLE_DEVICES``), and
none already left out. A sick GPU is one observation naming it (``sick_gpus``) and every GPU NVML saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rewind.infra.health import nvml, xid
from rewind.infra.launch.observe import Observation, Seen


class GpuWatch:
    def __init__(
        self,
        probe: Callable[[], list[nvml.GpuHealth]],
        check_s: float | None,
        excluded: set[int],
        xids: Callable[[], xid.XidWatch | None] = xid.watch,
    ) -> None:
        self.probe, self.check_s, self.excluded = probe, check_s, excluded
        self.visible: set[str] | None = None  # CUDA_VISIBLE_DEVICES of the launch; None: every GPU
        self._next = time.monotonic() + (check_s or 0)
        self._xids = xids() if check_s else None

    def launch_sees(self, given: str | None) -> None:
        """The devices the launch was given (indices; UUIDs or none: every GPU counts)."""
        listed = {d.strip() for d in (given or "").split(",") if d.strip()}
        self.visible = listed if listed and all(d.isdigit() for d in listed) else None

    def _mine(self, index: int) -> bool:
        return (self.visible is None or str(index) in self.visible) and index not in self.excluded

    def observe(self, now: float) -> list[Observation]:
        return self._xid_events(now) + self._health(now)

    def _health(self, now: float) -> list[Observation]:
        if not self.check_s or time.monotonic() < self._next:
            return []
        self._next = time.monotonic() + self.check_s
        try:
            every = self.probe()
        except nvml.NoNvidiaDriver:
            self.check_s = None  # no driver here: GPU health is not monitored
            return []
        sick = [g for g in every if not g.healthy and self._mine(g.index)]
        if not sick:
            return []
        why = "; ".join(f"GPU {g.index} ({g.name}): {', '.join(g.problems)}" for g in sick)
        detail = {"reason": why, "sick_gpus": [g.index for g in sick], "gpus": [g.index for g in every]}
        return [Observation(Seen.GPU, now, None, detail)]

    def _xid_events(self, now: float) -> list[Observation]:
        if self._xids is None:
            return []
        faults = [e for e in self._xids.drain() if e.device_fault and self._mine(e.gpu)]
        if not faults:
            return []
        try:
            every = [g.index for g in self.probe()]
        except nvml.NoNvidiaDriver:
            every = []
        sick = sorted({e.gpu for e in faults})
        why = "; ".join(e.describe() for e in faults)
        detail = {"reason": why, "sick_gpus": sick, "gpus": every or sick, "xids": [e.xid for e in faults]}
        return [Observation(Seen.GPU, min(e.at for e in faults), None, detail)]

    def close(self) -> None:
        if self._xids is not None:
            self._xids.stop()
            self._xids = None
