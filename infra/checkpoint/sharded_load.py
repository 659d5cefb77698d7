"""Loading a multi-rank checkpoint on one rank: its tensors through DCP, every file verified as it is read,
and its non-tensor values (rank 0's tree, with other ranks' own values where this rank holds keys rank 0
did not: pipeline stages)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from rewind.infra.checkpoint.sharded_save import OWN_VALUES, RANK_FILE, rank_state_file
from rewind.infra.checkpoint.spread import SHARED_STATE
from rewind.infra.errors import ConfigError, CorruptCheckpoint, StateMismatch, UnloadableCheckpoint
from rewind.infra.format import dcp as verified_dcp
from rewind.infra.format import manifest as mf
from rewind.infra.format import payload, tree
from rewind.infra.format.nearest import Nearest
from rewind.infra.format.verify import Finding, Problem

PER_RANK_PREFIX = "data_rank"  # a rank's own loader state (``sharded.per_rank_part``)


def unwrap(directory: Path, exc: BaseException) -> BaseException:
    """DCP gathers every rank's failure into one CheckpointException: the most telling one, as Rewind's."""
    failures = [e for e, _trace in getattr(exc, "failures", {}).values()] or [exc]
    corrupt = [
        e for e in failures if isinstance(e, CorruptCheckpoint) and not isinstance(e, UnloadableCheckpoint)
    ]
    if corrupt:
        return CorruptCheckpoint(str(directory), [f for e in corrupt for f in e.findings])
    for kind in (UnloadableCheckpoint, OSError):
        found = [e for e in failures if isinstance(e, kind)]
        if found:
            return found[0]
    return failures[0]


def load(
    directory: Path, manifest: mf.Manifest, state: dict[str, Any], reads: Nearest | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: load a copy whose manifest matched the catalog into ``state``'s tensors, in place.

    Every file is verified as it is read (``VerifiedReader``), from ``reads`` where given (a nearer copy's
    files first, the bytes each place served counted). Returns (the saved tree with the loaded tensors,
    this rank's own state); a rank that did not exist when the checkpoint was saved gets rank 0's state.
    """
    reads = reads if reads is not None else Nearest(directory)
    entries = {e.path: e for e in manifest.files}
    if payload.DCP_METADATA not in entries:  # the caller's mistake, not the checkpoint's: condemn nothing
        raise ConfigError(f"{directory} is not a sharded (DCP) checkpoint: load it with Checkpointer")
    _same_world_for_per_rank_data(directory, manifest, state)
    template, tensors = tree.split(state, "s")  # the same names as at save time: where to load into
    try:
        verified_dcp.load(tensors, directory, entries, reads=reads)
    except BaseException as exc:  # CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise unwrap(directory, exc) from exc
    own = rank_state_file(dist.get_rank())
    own = own if own in entries else rank_state_file(0)
    for needed in (SHARED_STATE, own):
        if needed not in entries:
            raise UnloadableCheckpoint(
                str(directory), [Finding(Problem.CONTENT, needed, "not in the manifest")]
            )
    try:
        restored = tree.join(shared_values(directory, entries, template, reads), tensors)
        mine = tree.join(_without_own_values(payload.read_json(directory, entries[own], reads)), {})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UnloadableCheckpoint(
            str(directory), [Finding(Problem.CONTENT, SHARED_STATE, str(exc))]
        ) from exc
    return restored, mine


def _same_world_for_per_rank_data(directory: Path, manifest: mf.Manifest, state: dict[str, Any]) -> None:
    """A loader whose state is each rank's own (torchdata's StatefulDataLoader) is restored by the same
    ranks only: on another world size the job refuses the checkpoint, which condemns nothing."""
    saved, world = manifest.layout.get("world_size"), dist.get_world_size()
    mine = [k for k in state if k.startswith(PER_RANK_PREFIX)]
    if mine and saved != world:
        raise StateMismatch(
            str(directory),
            [Finding(Problem.CONTENT, mine[0], f"the loader's state is per rank: saved by {saved} ranks, this job "
                     f"has {world}; resume on {saved}, or give the session a ResumableLoader (a global position)")],
        )  # fmt: skip


def shared_values(
    directory: Path, entries: dict[str, Any], template: Any, reads: Nearest | None = None
) -> Any:
    """Rank 0's state tree, and where ``template`` (what this rank loads into) has a part's keys it lacks
    (pipeline stages: each rank held some of the model), the other ranks' own values for them."""
    base = _held(payload.read_json(directory, entries[SHARED_STATE], reads), template)
    if not _lacks(base, template):
        return base
    ranks = {int(m[1]): n for n in entries if (m := RANK_FILE.fullmatch(n))}
    for name in [ranks[r] for r in sorted(ranks) if r > 0]:
        theirs = payload.read_json(directory, entries[name], reads)
        own = theirs.get(OWN_VALUES) if isinstance(theirs, dict) else None
        for part, values in own.items() if isinstance(own, dict) else ():
            if part not in base:
                base[part] = values
            elif isinstance(base[part], dict) and isinstance(values, dict):
                base[part] = {**values, **base[part]}
    return _held(base, template)


def _held(base: Any, template: Any) -> Any:
    """The saved tree without what this rank does not load (another pipeline stage's tensors, another rank's
    own loader state): the template, what this rank holds, decides what is loaded, as in DCP."""
    if not isinstance(base, dict) or not isinstance(template, dict):
        return base
    out = {part: values for part, values in base.items() if part in template}  # another rank's own loader
    for part, values in out.items():
        want = template.get(part)
        if isinstance(values, dict) and isinstance(want, dict):
            out[part] = {k: v for k, v in values.items() if k in want or not _is_tensor(v)}
    return out


def _is_tensor(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"__tensor__"}


def _without_own_values(rank_tree: Any) -> Any:
    if isinstance(rank_tree, dict):
        return {k: v for k, v in rank_tree.items() if k != OWN_VALUES}
    return rank_tree


def _lacks(base: Any, template: Any) -> bool:
    if not isinstance(base, dict) or not isinstance(template, dict):
        return False
    return any(
        part not in base
        or (isinstance(want, dict) and isinstance(base[part], dict) and set(want) - set(base[part]))
        for part, want in template.items()
    )


class CheckpointFailures(Exception):
    """Failures gathered from every rank, shaped like DCP's CheckpointException for :func:`unwrap`."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__(f"{len(errors)} rank(s) failed")
        self.failures = {i: (e, None) for i, e in enumerate(errors)}
