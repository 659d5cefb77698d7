"""GPU health through NVML (``nvidia-ml-py``), behind a narrow seam.

``probe()`` loads the real library; tests hand ``read_devices`` any object with
the same few functions. A machine without a driver gets ``NoNvidiaDriver`` with
a plain message, not a crash.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewind.infra.errors import RewindError

HOT_C = 85  # above this a GPU is reported as too hot


class NoNvidiaDriver(RewindError):
    """NVML cannot be loaded: no NVIDIA driver on this machine."""


@dataclass(frozen=True, slots=True)
class GpuHealth:
    index: int
    name: str
    temperature_c: int
    ecc_uncorrected: int | None
    retired_pages: int | None
    remapped_rows_pending: bool | None
    throttle_reasons: tuple[str, ...]
    problems: tuple[str, ...] = field(default=())

    @property
    def healthy(self) -> bool:
        return not self.problems


_THROTTLE_NAMES = {
    0x0000000000000002: "applications_clocks",
    0x0000000000000004: "sw_power_cap",
    0x0000000000000008: "hw_slowdown",
    0x0000000000000020: "sw_thermal",
    0x0000000000000040: "hw_thermal",
    0x0000000000000080: "hw_power_brake",
}
_BAD_THROTTLE = {"hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}


def _optional(fn: Any, *args: Any) -> Any:
    """NVML calls some GPUs do not support answer NVMLError_NotSupported: report None, not a failure."""
    try:
        return fn(*args)
    except Exception:
        return None


def read_devices(nv: Any) -> list[GpuHealth]:
    """Read every device through ``nv`` (the ``pynvml`` module or a stand-in with the same functions)."""
    out = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        name = nv.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else str(name)
        temp = int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        ecc = _optional(
            nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
        )
        pages = _optional(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        remap = _optional(nv.nvmlDeviceGetRemappedRows, h)
        reasons_mask = _optional(nv.nvmlDeviceGetCurrentClocksThrottleReasons, h) or 0
        reasons = tuple(n for bit, n in _THROTTLE_NAMES.items() if reasons_mask & bit)
        pending = bool(remap[2]) if remap else None
        problems = []
        if temp >= HOT_C:
            problems.append(f"temperature {temp}C")
        if ecc:
            problems.append(f"{ecc} uncorrected ECC errors")
        if pending:
            problems.append("row remapping pending (reset needed)")
        problems += [f"throttled: {r}" for r in reasons if r in _BAD_THROTTLE]
        out.append(
            GpuHealth(
                i,
                name,
                temp,
                None if ecc is None else int(ecc),
                None if pages is None else len(pages),
                pending,
                reasons,
                tuple(problems),
            )
        )
    return out


STANDIN_ENV = "REWIND_NVML_STANDIN"  # a JSON file of GPUs (and Xid events) read instead of NVML


class StandIn:
    """NVML's few functions over a JSON file, for machines without a GPU (drills, tests): ``{"gpus":
    [{"name", "temperature", "ecc"}...], "xids": [{"gpu", "xid"}...]}``; read afresh at every call, so a
    drill changes what the supervisor sees by writing the file."""

    NVML_TEMPERATURE_GPU, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.data = self.read()

    def read(self) -> dict[str, Any]:
        try:
            got = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise NoNvidiaDriver(f"{STANDIN_ENV}={self.path}: not a readable stand-in ({exc})") from exc
        return got if isinstance(got, dict) else {}

    def _gpu(self, i: int) -> dict[str, Any]:
        return dict(self.data.get("gpus", [])[i])

    def nvmlDeviceGetCount(self) -> int:
        return len(self.data.get("gpus", []))

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self._gpu(h).get("name", "stand-in GPU"))

    def nvmlDeviceGetTemperature(self, h: int, _kind: int) -> int:
        return int(self._gpu(h).get("temperature", 40))

    def nvmlDeviceGetTotalEccErrors(self, h: int, _t: int, _c: int) -> int:
        return int(self._gpu(h).get("ecc", 0))

    def nvmlDeviceGetRetiredPages(self, h: int, _cause: int) -> list[int]:
        return []

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return (0, 0, 0, 0)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return 0


def probe() -> list[GpuHealth]:
    """Health of every GPU on this machine; raises NoNvidiaDriver where there is none."""
    standin = os.environ.get(STANDIN_ENV)
    if standin:
        return read_devices(StandIn(standin))
    try:
        import pynvml as nv

        nv.nvmlInit()
    except Exception as exc:
        raise NoNvidiaDriver(f"no NVIDIA driver: NVML could not be loaded ({exc})") from exc
    try:
        return read_devices(nv)
    finally:
        nv.nvmlShutdown()
