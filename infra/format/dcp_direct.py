"""The plain format for multi-rank (DCP) checkpoints, written by Rewind's own file writer.

DCP plans what each rank writes and records, per write item, the file, offset and length it lies at
(``.metadata``); its ``FileSystemWriter`` then writes each rank's file through the page cache, and the
file would have to be read back to be hashed. ``DirectWriter`` keeps DCP's planning, metadata and
encoding (``torch.save`` of each tensor, a value's bytes as they are: the same ``__<rank>_0.distcp`` DCP's
own reader and ``dcp.load`` read) but streams the rank's items into one file through
:func:`rewind.infra.format.store.write_file`: hashed as it is written, past the page cache where the
filesystem allows (``infra/format/direct.py``), fsynced. Its manifest entry comes from that one pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from rewind.infra.format import manifest as mf
from rewind.infra.format import store
from rewind.infra.format.dcp_packs import item_tensor

SUFFIX = ".distcp"  # DCP's own (``filesystem.DEFAULT_SUFFIX``)


class _Counted:
    """The file being written, as ``torch.save`` writes to it: where each item starts and ends, and the
    first write that failed (``torch.save`` reports a failed write as a later, unrelated position error)."""

    def __init__(self, out: Any) -> None:
        self._out, self.at = out, 0
        self.failed: BaseException | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            n = self._out.write(data)
        except BaseException as exc:
            self.failed = self.failed or exc
            raise
        self.at += n
        return n

    def flush(self) -> None:  # torch.save flushes its stream; the file is fsynced once, when whole
        pass


def _write_item(out: _Counted, planner: SavePlanner, item: WriteItem) -> None:
    """One item in DCP's encoding: a value's bytes as they are, a tensor as ``torch.save`` of it."""
    if item.type == WriteItemType.BYTE_IO:
        out.write(planner.resolve_data(item).getbuffer())  # type: ignore[union-attr]
        return
    try:
        torch.save(item_tensor(planner, item), out)  # type: ignore[arg-type]  # it needs write and flush
    except Exception:
        if out.failed is not None:  # the disk's own error (ENOSPC, EIO), not torch's account of it
            raise out.failed from None
        raise


class DirectWriter(dcp.FileSystemWriter):
    """DCP's file system writer, each rank's items in one file written and hashed in one pass; its
    manifest entries in ``entries`` once ``dcp.save`` returned."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), sync_files=True)
        self.entries: list[mf.FileEntry] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{SUFFIX}"  # DCP's own name for a rank's first file
        results: list[WriteResult] = []

        def fill(raw: Any) -> None:
            out = _Counted(raw)
            for item in plan.items:
                start = out.at
                _write_item(out, planner, item)
                info = _StorageInfo(name, start, out.at - start)
                results.append(WriteResult(index=item.index, size_in_bytes=out.at - start, storage_data=info))

        self.entries.append(store.write_file(Path(self.path) / name, fill))  # ``reset`` may move it
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done
