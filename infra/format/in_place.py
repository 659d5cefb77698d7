"""A module's own tensors loaded straight from a memory copy, each segment's bytes right after it is proven.

A module loaded by torch's own code copies each tensor it is given into its parameter or buffer
(``rewind.infra.checkpoint.own_tensors``). Given tensors over a memory copy's mapping, that copy reads
every byte from memory a second time, after the hash read it once. Where the module has, for every tensor
of its part's file and nothing else, a parameter or buffer of that tensor's dtype and shape (the load would
take every one), each segment's bytes are copied into them as soon as that segment matched the catalog's
digest (``rewind.infra.format.segments``), while they are still in the CPU's cache; the module is then
given its own tensors, which torch's load does not copy again (a copy of a tensor onto itself is skipped).

No byte reaches a module before the segment it lies in matched. A file that fails part way has left the
module holding some proven bytes of it: the caller must load the part whole from another copy, or not
carry on as if the module were untouched (``Checkpointer.restore_latest`` then refuses to start over).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rewind.infra.format.tensorfile import Span


@dataclass(frozen=True, slots=True)
class Placement:
    """One tensor's bytes, ``start`` .. ``end`` from the file's start, go to the address ``dest``: the first
    byte of ``target``, held here so that it lives as long as anything may copy into it."""

    start: int
    end: int
    dest: int
    target: torch.Tensor = field(compare=False, repr=False)


def plan(data: int, spans: Sequence[Span], into: Mapping[str, torch.Tensor]) -> tuple[Placement, ...]:
    """Where each tensor of a file goes (``data``: where its tensors' bytes start; ``spans`` in file order);
    empty unless ``into`` has exactly the file's tensors by name, each of its tensor's dtype and shape,
    contiguous on the CPU, no two of them overlapping unless they are the same bytes (tied weights: of
    those only the last in ``into``'s order is copied, as torch's load, copying each in turn, leaves it)."""
    if len(spans) != len(into) or {sp.name for sp in spans} != set(into):
        return ()
    last: dict[tuple[int, int], tuple[int, Placement]] = {}  # by destination: (its order in into, where from)
    order = {name: i for i, name in enumerate(into)}
    for sp in spans:
        t = into[sp.name]
        fits = t.dtype == sp.dtype and list(t.shape) == sp.shape and t.device.type == "cpu"
        if not (fits and t.is_contiguous()):
            return ()
        if sp.end > sp.start:
            dest = (t.data_ptr(), sp.end - sp.start)
            if dest not in last or last[dest][0] < order[sp.name]:
                last[dest] = (order[sp.name], Placement(data + sp.start, data + sp.end, t.data_ptr(), t))
    if not _apart(list(last)):
        return ()
    return tuple(sorted((p for _, p in last.values()), key=lambda p: p.start))


def _apart(destinations: Sequence[tuple[int, int]]) -> bool:
    """Whether no two destinations (address, length; each once) overlap."""
    ranges = sorted((at, at + n) for at, n in destinations)
    return all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(ranges))


def copy_proven(placements: Sequence[Placement], lo: int, hi: int, base: int) -> None:
    """The bytes ``lo`` .. ``hi`` of the file mapped at ``base`` (a segment just proven) copied into the
    tensors that take them (``placements`` in file order, none overlapping another in the file). The caller
    must hold the mapping (an export of it) until this returns."""
    first = bisect.bisect_right(placements, lo, key=lambda p: p.end)
    for p in placements[first:]:
        if p.start >= hi:
            break
        a, b = max(p.start, lo), min(p.end, hi)
        ctypes.memmove(p.dest + (a - p.start), base + a, b - a)
