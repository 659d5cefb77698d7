"""Reading a copy's files from a nearer copy of some of them first (this node's memory), every file read
whole and proven against its entry wherever it is read; a nearer file that does not prove is read from the
copy itself instead. Counts the bytes each place served, so that a restore can say what it read from where."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rewind.infra.errors import CorruptCheckpoint
from rewind.infra.format import manifest as mf
from rewind.infra.format.verify import read_verified

log = logging.getLogger("rewind.restore")


@dataclass
class Nearest:
    """``directory``: the copy; ``nearer``: manifest path -> a directory holding that file nearer (read first).
    ``near_bytes`` and ``here_bytes``: what each served so far; ``missed``: the nearer files that did not
    prove (path, their directory), for whoever keeps that copy to drop."""

    directory: Path
    nearer: Mapping[str, Path] = field(default_factory=dict)
    near_bytes: int = 0
    here_bytes: int = 0
    missed: list[tuple[str, Path]] = field(default_factory=list)

    def read(self, entry: mf.FileEntry) -> bytes:
        """The file's bytes, proven to be ``entry``'s (``CorruptCheckpoint`` when the copy's are not)."""
        place = self.nearer.get(entry.path)
        if place is not None:
            try:
                data = read_verified(place, entry)
                self.near_bytes += len(data)
                return data
            except (CorruptCheckpoint, OSError) as exc:  # the copy itself still holds it
                if isinstance(exc, CorruptCheckpoint):
                    self.missed.append((entry.path, place))
                log.warning("%s not read from %s (%s): read from %s", entry.path, place, exc, self.directory)
        data = read_verified(self.directory, entry)
        self.here_bytes += len(data)
        return data
