"""A checkpoint's parts read (every byte verified) and given to the job's state objects.

One ``PartLoader`` per checkpointer: it is the loader the one restore path calls for each copy it tries
(``rewind.infra.restore.execute``). A module whose own tensors a memory copy is loaded straight into
(``rewind.infra.format.in_place``) is written before every part is applied; a load that wrote into one and
then failed leaves ``part_loaded`` set until a later load succeeds, so that the checkpointer never starts
over from a module holding part of a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from rewind.infra.checkpoint import own_tensors
from rewind.infra.checkpoint.state import Stateful
from rewind.infra.errors import StateMismatch
from rewind.infra.format import manifest as mf
from rewind.infra.format import payload
from rewind.infra.format.verify import Finding, Problem

# What a state object's load_state_dict raises when it refuses what it is given (shape, type, keys).
_REFUSALS = (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError, AssertionError)


@dataclass
class PartLoader:
    """Loads a checkpoint's directory into ``parts`` (by part name)."""

    parts: Mapping[str, Stateful]
    part_loaded: bool = (
        False  # a load that wrote into a module's own tensors failed, and none succeeded since
    )

    def __call__(self, directory: Path, manifest: mf.Manifest) -> None:
        """Read (verifying every byte) and apply; a state the job refuses is a ``StateMismatch``."""
        copied = [name for name, s in self.parts.items() if own_tensors.copies_on_load(s)]
        into = {name: own_tensors.targets(self.parts[name]) for name in copied}  # type: ignore[arg-type]
        before = own_tensors.versions(into)
        try:
            self._load(directory, manifest, copied, into)
        except BaseException:
            self.part_loaded = self.part_loaded or own_tensors.versions(into) != before
            raise
        self.part_loaded = False

    def _load(
        self,
        directory: Path,
        manifest: mf.Manifest,
        copied: list[str],
        into: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        states = payload.read_states(directory, manifest, copied=copied, into=into)
        missing = sorted(set(self.parts) - set(states))
        if missing:
            raise StateMismatch(
                str(directory), [Finding(Problem.CONTENT, ",".join(missing), "no such state saved")]
            )
        mapped: dict[str, Any] = {}
        for name, stateful in self.parts.items():
            module = cast(torch.nn.Module, stateful) if name in copied else None  # copies_on_load: a module
            handed = own_tensors.storages(states[name], module) if module is not None else frozenset()
            try:
                _apply(directory, name, stateful, states[name])
            finally:  # loaded or refused part-way: nothing it kept may hold a memory copy's pages
                if module is not None and handed:
                    own_tensors.own_kept(module, handed)
                    mapped[name] = states.pop(name)
        if mapped:
            own_tensors.let_go(mapped)  # the mappings' teardown off the restore's path; the rest dropped here


def _apply(directory: Path, name: str, stateful: Stateful, state: Any) -> None:
    try:
        stateful.load_state_dict(state)
    except torch.OutOfMemoryError:
        raise  # this process, not the checkpoint: nothing to judge it by
    except _REFUSALS as exc:  # the user's object refused it: which side is wrong is decided later
        detail = f"{type(exc).__name__}: {str(exc)[:300]}"
        raise StateMismatch(str(directory), [Finding(Problem.CONTENT, name, detail)]) from exc
