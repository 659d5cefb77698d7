"""Xid errors as they happen, through NVML's event API, where the driver offers it.

A GPU that falls off the bus (Xid 79), loses memory to a double-bit error (48, 94, 95, 64) or whose
firmware stops answering (119, 120) is sick now, not at the next health poll: ``XidWatch`` waits on an
NVML event set (``nvmlDeviceRegisterEvents`` with ``nvmlEventTypeXidCriticalError``, per device where it
is supported) in a thread of its own and keeps the events until the supervisor drains them. The Xids a
program causes itself (13, 31, 43, 45: an illegal address, a fault, a process killed) are kept too but
do not make the device sick: the program's crash says enough. On a machine without a GPU the same watch
reads ``REWIND_NVML_STANDIN``'s ``xids`` (the seam drills and tests inject through).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from rewind.infra.health.nvml import STANDIN_ENV, StandIn

log = logging.getLogger("rewind.xid")
# Xids of the device itself (NVIDIA's Xid catalogue): the GPU must be left out
DEVICE_XIDS = frozenset({48, 61, 62, 64, 74, 79, 94, 95, 119, 120, 140})
WHAT = {
    48: "double-bit ECC error", 64: "row remapping failed", 74: "NVLink error", 79: "fallen off the bus",
    94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP timeout", 120: "GSP error",
}  # fmt: skip
WAIT_MS = 500


@dataclass(frozen=True, slots=True)
class XidEvent:
    gpu: int  # NVML index
    xid: int
    at: float

    @property
    def device_fault(self) -> bool:
        return self.xid in DEVICE_XIDS

    def describe(self) -> str:
        what = WHAT.get(self.xid)
        return f"Xid {self.xid} on GPU {self.gpu}" + (f" ({what})" if what else "")


class XidWatch:
    """Events gathered by a thread; ``drain()`` hands over those seen since the last call."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._events: list[XidEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rewind-xid", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        warned = False
        while not self._stop.is_set():
            try:
                got = self._source.wait(WAIT_MS)
            except Exception as exc:  # a driver error is no reason to stop watching: said once, tried again
                if not warned:
                    log.warning("Xid events could not be read (trying again): %s", exc)
                    warned = True
                self._stop.wait(1.0)
                continue
            if got:
                with self._lock:
                    self._events += got

    def drain(self) -> list[XidEvent]:
        with self._lock:
            got, self._events = self._events, []
        return got

    def stop(self) -> None:
        """The thread ended (a wait lasts ``WAIT_MS`` at most), then the event set freed."""
        self._stop.set()
        self._thread.join(timeout=5 * WAIT_MS / 1000)
        if not self._thread.is_alive():
            self._source.close()


class _NvmlEvents:
    """The driver's event set: every device that supports Xid events registered."""

    def __init__(self) -> None:
        import pynvml as nv

        nv.nvmlInit()
        self.nv, self.set = nv, nv.nvmlEventSetCreate()
        self.index: dict[
            int | None, int
        ] = {}  # a device handle's address -> its index (a lost GPU has no PCI info)
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self.set)
                self.index[_address(h)] = i
            except nv.NVMLError as exc:  # not supported on this device or driver: its health poll stays
                log.info("GPU %d: Xid events not supported (%s)", i, exc)
        if not self.index:
            raise RuntimeError("no GPU here reports Xid events")

    def wait(self, ms: int) -> list[XidEvent]:
        try:
            data = self.nv.nvmlEventSetWait(self.set, ms)
        except self.nv.NVMLError_Timeout:
            return []
        return [XidEvent(self.index.get(_address(data.device), -1), int(data.eventData), time.time())]

    def close(self) -> None:
        try:
            self.nv.nvmlEventSetFree(self.set)
        finally:
            self.nv.nvmlShutdown()


def _address(handle: Any) -> int | None:
    import ctypes

    return ctypes.cast(handle, ctypes.c_void_p).value


class _StandInEvents:
    """``REWIND_NVML_STANDIN``'s ``xids``, each reported once, as it appears in the file."""

    def __init__(self, path: str) -> None:
        self.path, self.seen = path, len(StandIn(path).data.get("xids", []))

    def wait(self, ms: int) -> list[XidEvent]:
        time.sleep(ms / 1000)  # the file has no way to wake a waiter: it is read at the driver's pace
        try:
            xids = StandIn(self.path).read().get("xids", [])
        except Exception:  # a file being replaced: read at the next wait
            return []
        new, self.seen = xids[self.seen :], len(xids)
        return [XidEvent(int(x["gpu"]), int(x["xid"]), time.time()) for x in new]

    def close(self) -> None:
        return None


def watch() -> XidWatch | None:
    """Xid events of this machine's GPUs as they happen; None where the driver offers none (no GPU, an old
    driver, a GPU without the event API: the periodic health poll still runs)."""
    try:
        source: Any = (
            _StandInEvents(os.environ[STANDIN_ENV]) if os.environ.get(STANDIN_ENV) else _NvmlEvents()
        )
    except Exception as exc:
        log.info("no Xid events watched here: %s", exc)
        return None
    return XidWatch(source)
