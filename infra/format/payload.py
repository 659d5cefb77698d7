"""What goes into the files of a checkpoint, and how it comes back out.

One ``<name>.safetensors`` per stateful part that holds tensors, and one
``state.json`` with every part's non-tensor state. Each file is read once, hashed
as it is read, and nothing it holds is returned before its digest matched the
manifest (which the caller has already held to the catalog's record). Bytes that
match but do not decode are the checkpoint's own fault, not a copy's: they raise
``UnloadableCheckpoint``, never ``CorruptCheckpoint``.
"""

from __future__ import annotations

import binascii
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from rewind.infra.errors import ConfigError, MalformedFile, UnloadableCheckpoint
from rewind.infra.format import chunked, mapped, tensorfile, tree
from rewind.infra.format import manifest as mf
from rewind.infra.format.nearest import Nearest
from rewind.infra.format.store import FileWriter, Hashed, Link
from rewind.infra.format.verify import Finding, Problem, read_verified, verified_read

STATE_FILE = "state.json"
PLAIN = "plain"  # one safetensors file per state
CHUNKED = "chunked"  # content-addressed chunks, linked from the previous checkpoint where unchanged
FORMATS = (PLAIN, CHUNKED)


def check_format(fmt: str) -> str:
    """``fmt`` if it names a checkpoint format; a one-line ``ConfigError`` otherwise."""
    if fmt not in FORMATS:
        raise ConfigError(f"checkpoint format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


DCP_METADATA = ".metadata"  # present only in sharded (DCP) checkpoints
_DECODE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, binascii.Error, RecursionError)


def _refuse_twice(directory: Path, path: str, tensors: Mapping[str, Any], got: Mapping[str, Any]) -> None:
    """A file naming a tensor another file named too (a checkpoint saved before ``split_states`` refused it):
    which one a part should get cannot be told."""
    twice = sorted(set(tensors) & set(got))
    if twice:
        raise _unloadable(directory, path, f"tensor {twice[0]!r} is in another file too")


def tensor_file(part: str) -> str:
    """The plain format's file of ``part``'s tensors."""
    return f"{part}.safetensors"


def split_states(state_dicts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``{part: state_dict}`` -> (JSON trees per part, tensors per part). Two parts' tensors of one name (part
    ``model``'s ``ema.weight`` and part ``model.ema``'s ``weight``) are a ``ConfigError``: a restore finds
    each tensor by its name."""
    trees: dict[str, Any] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    owner: dict[str, str] = {}
    for part, sd in state_dicts.items():
        trees[part], tensors[part] = tree.split(sd, part, strides=True)
        for name in tensors[part]:
            if owner.setdefault(name, part) != part:
                raise ConfigError(
                    f"states {owner[name]!r} and {part!r} both hold a tensor named {name!r}: rename one of them"
                )
    return trees, tensors


@dataclass(frozen=True, slots=True)
class Prehashed:
    """Digests of a save's bytes computed before its files are laid out (in the stall, or in one pass over
    the staged state): whole files by name, written as hashed; chunks by (state, tensor, first row)."""

    files: Mapping[str, Hashed] = field(default_factory=dict)
    chunks: Mapping[chunked.ChunkKey, str] = field(default_factory=dict)


def file_writers(
    trees: Mapping[str, Any],
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    fmt: str = PLAIN,
    link_from: chunked.Parent | None = None,
    prehashed: Prehashed | None = None,
) -> list[tuple[str, FileWriter | Link | Hashed]]:
    """The files of a checkpoint, as (name, function that streams its bytes, or a link, or a file hashed
    already).

    ``fmt="chunked"`` selects the chunked format (:mod:`rewind.infra.format.chunked`), hard-linking
    the packs that the checkpoint ``link_from`` (held to its catalog digest) already holds.
    ``prehashed``: a file it names is written as hashed (a link stays a link); its chunks are not hashed
    again.
    """
    pre = prehashed or Prehashed()

    def tensors_writer(part_tensors: Mapping[str, torch.Tensor]) -> FileWriter:
        return lambda out: tensorfile.write(out, part_tensors)

    def state_writer(out: BinaryIO) -> None:
        out.write(json.dumps(trees, allow_nan=True).encode())  # keys in the state's order: it comes back so

    files: list[tuple[str, FileWriter | Link]]
    if fmt == CHUNKED:
        files = chunked.file_writers(tensors, link_from, pre.chunks)
    else:
        files = [(tensor_file(part), tensors_writer(t)) for part, t in tensors.items() if t]
    files.append((STATE_FILE, state_writer))
    return [(n, f if isinstance(f, Link) else pre.files.get(n, f)) for n, f in files]


def adopted_format(manifest: mf.Manifest) -> str | None:
    """The format of a checkpoint Rewind adopted (``hf-trainer``, ``dcp``...), None for one Rewind wrote."""
    engine = str(manifest.writer.get("engine", ""))
    return engine.removeprefix("adopted:") if engine.startswith("adopted:") else None


def _unloadable(directory: Path, path: str, why: str) -> UnloadableCheckpoint:
    return UnloadableCheckpoint(str(directory), [Finding(Problem.CONTENT, path, why)])


def read_tensors(
    directory: Path,
    entry: mf.FileEntry,
    *,
    may_map: bool = False,
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One safetensors file, verified against ``entry``; every tensor has a storage of its own. ``may_map``:
    a file on a memory filesystem is mapped copy-on-write instead (``mapped``), for tensors the caller
    copies into its own and lets go (a first write to a mapped page costs more than the copy saved).
    ``into``: the caller's own tensors by name, which such a file, proven a segment at a time, is loaded
    straight into where they take every tensor of it (``in_place``): then they are what is returned."""
    if may_map and into and mapped.verified_into(directory, entry, into):
        return dict(into)
    problem: Exception | None = None
    proven = mapped.verified_mapping(directory, entry) if may_map else None
    if proven is not None:
        try:
            return tensorfile.over(proven)[0]
        except (ValueError, EOFError) as exc:  # the bytes are the recorded ones: the writer made a bad file
            raise _unloadable(directory, entry.path, str(exc)) from exc
    with verified_read(directory, entry) as reader:
        try:
            tensors, _meta = tensorfile.read(reader, entry.size)
        except (ValueError, EOFError) as exc:
            problem, tensors = exc, {}
    if problem is not None:  # the bytes are the recorded ones: the writer made a bad file
        raise _unloadable(directory, entry.path, str(problem))
    return tensors


def read_json(directory: Path, entry: mf.FileEntry, reads: Nearest | None = None) -> Any:
    """A JSON file, verified against ``entry`` before it is decoded (``reads``: a nearer copy's first)."""
    data = reads.read(entry) if reads is not None else read_verified(directory, entry)
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _unloadable(directory, entry.path, f"not JSON ({str(exc)[:200]})") from exc


def read_states(
    directory: Path,
    manifest: mf.Manifest,
    *,
    copied: Collection[str] = (),
    into: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Verified state dicts per part. ``copied``: the parts whose tensors the caller copies into tensors of
    its own as it loads them (a module's ``load_state_dict``): read from a memory tier without a copy.
    ``into``: for some of those, those tensors of its own by state key: loaded into straight from a memory
    copy where they take the part's every tensor (``read_tensors``), and then handed back in its state.

    ``CorruptCheckpoint`` names a file whose bytes differ; ``UnloadableCheckpoint`` one
    whose bytes match but whose content cannot be a state; ``OSError`` is an I/O error.
    """
    entries = {e.path: e for e in manifest.files}
    adopted = adopted_format(manifest)
    if adopted is not None:  # the user's own files, not Rewind's: the caller's mistake, condemn nothing
        raise ConfigError(
            f"{directory} is an adopted {adopted} checkpoint, not one Rewind wrote: load it with what wrote it "
            "(rewind.infra.restore.foreign: verified_directory, load_dcp), or export its model for serving"
        )
    if DCP_METADATA in entries:  # the caller's mistake, not the checkpoint's: condemn nothing
        raise ConfigError(f"{directory} is a sharded (DCP) checkpoint: load it with ShardedCheckpointer")
    if STATE_FILE not in entries:
        raise _unloadable(directory, STATE_FILE, "not listed in the manifest")
    trees = read_json(directory, entries[STATE_FILE])
    if not isinstance(trees, dict):
        raise _unloadable(directory, STATE_FILE, f"holds a {type(trees).__name__}, not one state per part")
    tensors: dict[str, torch.Tensor] = {}
    mappable = {tensor_file(part) for part in copied}
    targets = _by_name(trees, into or {})
    for path, entry in entries.items():
        if path.endswith(".safetensors"):
            got = read_tensors(directory, entry, may_map=path in mappable, into=targets.get(path))
            _refuse_twice(directory, path, tensors, got)
            tensors.update(got)
    if chunked.INDEX_FILE in entries:
        index = read_json(directory, entries[chunked.INDEX_FILE])
        try:
            got = chunked.read_tensors(directory, entries, index)
        except MalformedFile as exc:  # the index matched the manifest: the writer made it so
            raise _unloadable(directory, chunked.INDEX_FILE, str(exc)) from exc
        _refuse_twice(directory, chunked.INDEX_FILE, tensors, got)
        tensors.update(got)
    try:
        return {str(part): tree.join(t, tensors, layouts=part not in copied) for part, t in trees.items()}
    except _DECODE_ERRORS as exc:
        raise _unloadable(directory, STATE_FILE, f"{type(exc).__name__}: {str(exc)[:300]}") from exc


def _by_name(
    trees: Mapping[str, Any], into: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Per tensor file, the caller's tensors by the names its part's saved state gives their keys: for each
    part whose state is flat (a module's) with exactly those keys."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for part, by_key in into.items():
        names = tree.tensor_names(trees.get(part))
        if by_key and names.keys() == by_key.keys():
            out[tensor_file(part)] = {names[k]: t for k, t in by_key.items()}
    return out


def data_position(directory: Path, manifest: mf.Manifest) -> dict[str, int]:
    """The data loader position a checkpoint recorded (its ``data`` state), read through verification."""
    entries = {e.path: e for e in manifest.files}
    trees = read_json(directory, entries[STATE_FILE]) if STATE_FILE in entries else {}
    data = trees.get("data") if isinstance(trees, dict) else None
    data = data if isinstance(data, dict) else {}
    try:
        consumed = int(data.get("consumed", 0))
        return {
            "epoch": int(data.get("epoch", 0)),
            "consumed": consumed,
            "total": int(data.get("total", consumed)),
        }
    except _DECODE_ERRORS as exc:
        raise _unloadable(directory, STATE_FILE, f"data position is not a number ({exc})") from exc
