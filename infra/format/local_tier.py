"""Which disk a local checkpoint directory lies on: a mark at the root of each local tier.

Node-local disks share paths (every host's ``/nvme/ckpt/run/step-10``), so a path does not say whose copy
it is. The first save into a checkpoint root writes ``.rewind-tier`` there: a random id and the host that
made it. A copy row records its tier's id; a machine judges a copy only when the mark above the copy's
directory, as this machine sees it, has that id: the same disk, here or shared (NFS: every host sees the
same mark). A path with no mark, or another id, is another disk: the copy is elsewhere, never missing here.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

MARK = ".rewind-tier"
DEPTH = 3  # <root>/<run>/step-N, and <root>/<run>/.quarantine/step-N-...


@dataclass(frozen=True, slots=True)
class LocalTier:
    id: str
    host: str  # where it was made (for people: the id is what identifies it)


def read(root: Path) -> LocalTier | None:
    """The tier whose root is ``root``; None when there is no readable mark."""
    try:
        raw = json.loads((root / MARK).read_text(encoding="utf-8"))
        return LocalTier(str(raw["id"]), str(raw.get("host", "?")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ensure(root: Path) -> LocalTier:
    """The tier at ``root``, its mark written first if it has none (atomic: one id, whoever races)."""
    found = read(root)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    made = LocalTier(uuid.uuid4().hex, socket.gethostname())
    tmp = root / f"{MARK}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps({"id": made.id, "host": made.host}), encoding="utf-8")
    try:
        os.link(tmp, root / MARK)  # fails if another process made it first: then that one is the tier
    except FileExistsError:
        if read(root) is None:  # a damaged mark: this disk's copies could never be told apart again
            os.replace(tmp, root / MARK)
    finally:
        tmp.unlink(missing_ok=True)
    return read(root) or made


def of_copy(directory: str | Path) -> LocalTier | None:
    """The tier holding a local copy, from the nearest mark above its directory (None: none is seen)."""
    p = Path(directory)
    for parent in list(p.parents)[1:DEPTH]:
        found = read(parent)
        if found is not None:
            return found
    return None
