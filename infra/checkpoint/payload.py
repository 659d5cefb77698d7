"""What goes into the files of a checkpoint, and how it comes back out.

One ``<name>.safetensors`` per stateful part that holds tensors, and one
``state.json`` with every part's non-tensor state. Reading goes through
:func:`verify.read_verified`, so no byte reaches a model before its digest matched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from infra.checkpoint import manifest as mf
from infra.checkpoint import tensorfile, tree
from infra.checkpoint.store import FileWriter
from infra.checkpoint.verify import Finding, Problem, read_verified
from infra.errors import CorruptCheckpoint

STATE_FILE = "state.json"


def split_states(state_dicts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``{part: state_dict}`` -> (JSON trees per part, tensors per part)."""
    trees: dict[str, Any] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for part, sd in state_dicts.items():
        trees[part], tensors[part] = tree.split(sd, part)
    return trees, tensors


def file_writers(
    trees: Mapping[str, Any], tensors: Mapping[str, Mapping[str, torch.Tensor]]
) -> list[tuple[str, FileWriter]]:
    """The files of a checkpoint, as (name, function that streams its bytes)."""

    def tensors_writer(part_tensors: Mapping[str, torch.Tensor]) -> FileWriter:
        return lambda out: tensorfile.write(out, part_tensors)

    def state_writer(out: BinaryIO) -> None:
        out.write(json.dumps(trees, sort_keys=True, allow_nan=True).encode())

    files = [(f"{part}.safetensors", tensors_writer(t)) for part, t in tensors.items() if t]
    files.append((STATE_FILE, state_writer))
    return files


def read_states(directory: Path, manifest: mf.Manifest) -> dict[str, Any]:
    """Verified state dicts per part; raises ``CorruptCheckpoint`` naming the file and reason."""
    location = str(directory)
    entries = {e.path: e for e in manifest.files}
    if STATE_FILE not in entries:
        raise CorruptCheckpoint(
            location, [Finding(Problem.MANIFEST, STATE_FILE, "not listed in the manifest")]
        )
    tensors: dict[str, torch.Tensor] = {}
    trees: dict[str, Any] = {}
    for path, entry in entries.items():
        buf = read_verified(directory, entry)
        try:
            if path == STATE_FILE:
                trees = json.loads(bytes(buf.numpy()))
            elif path.endswith(".safetensors"):
                part_tensors, _meta = tensorfile.parse(buf)
                tensors.update(part_tensors)
        except (ValueError, UnicodeDecodeError) as exc:
            # Digest matched, so the writer itself produced a bad file: still never load it.
            raise CorruptCheckpoint(location, [Finding(Problem.UNREADABLE, path, str(exc))]) from exc
    try:
        return {part: tree.join(t, tensors) for part, t in trees.items()}
    except KeyError as exc:
        raise CorruptCheckpoint(location, [Finding(Problem.UNREADABLE, STATE_FILE, str(exc))]) from exc
