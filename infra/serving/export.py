"""Export: a verified checkpoint becomes a TorchServe model archive that knows where it came from.

Only a checkpoint the catalog holds as ``verified`` is exported, and its bytes are
read through the one restore path (the nearest copy held to the catalog's manifest
digest, every byte hashed as it is read), so an archive never carries weights
whose digest did not match the catalog's record. The archive holds ``weights.safetensors`` (one part of the
checkpoint, ``model`` by default; of an adopted HF Trainer or safetensors checkpoint, its own
``model.safetensors``, read without writing into or judging the user's directory by Rewind's
format), the handler and its files, and ``rewind.json``
with the lineage (run, step, checkpoint id, manifest digest). It is built in a
temporary directory and renamed into the model store; an existing version is
never overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from rewind.infra import config
from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.errors import ConfigError, NotFoundError, UnloadableCheckpoint
from rewind.infra.format import manifest as mf
from rewind.infra.format import payload
from rewind.infra.format.digest import hash_file
from rewind.infra.format.verify import verify_files
from rewind.infra.launch.process import program
from rewind.infra.restore import execute, plan
from rewind.infra.serving.haproxy import VERSION_NAME

WEIGHTS = "weights.safetensors"
LINEAGE = "rewind.json"
ADOPTED_EXPORTABLE = ("hf-trainer", "safetensors")  # adopted formats whose model is a safetensors file
_HF_WEIGHTS = re.compile(r"model(?:-\d{5}-of-\d{5})?\.safetensors")


@dataclass(frozen=True, slots=True)
class Artifact:
    model: str
    version: str
    archive: Path  # in the model store, named <model>-<version>.mar
    digest: str  # xxh3-128 of the archive
    bytes: int
    checkpoint_id: int
    run: str
    step: int
    manifest_digest: str

    def as_dict(self) -> dict[str, object]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def archive_name(model: str, version: str) -> str:
    return f"{model}-{version}.mar"


def verified_checkpoint(cat: Catalog, run: str, step: int) -> Checkpoint:
    """The live checkpoint at ``run@step``; refuses one that is not verified, saying how to fix it."""
    rows = lineage.checkpoints(cat, run, step)  # a save in flight at the step: only where nothing else is
    live = [c for c in rows if c.status in (S.COMMITTED, S.VERIFIED, S.CORRUPT)] or [
        c for c in rows if c.status == S.WRITING
    ]
    if not live:
        raise NotFoundError(f"run {run!r} has no checkpoint at step {step}")
    ck = live[-1]
    if ck.status == S.CORRUPT:
        raise ConfigError(f"checkpoint {run}@{step} is corrupt, not verified: {ck.status_reason}")
    if ck.status != S.VERIFIED:
        raise ConfigError(
            f"checkpoint {run}@{step} is {ck.status}, not verified; "
            f"verify it first (rewind ckpt verify --deep {run} --step {step})"
        )
    return ck


def export(
    cat: Catalog,
    *,
    run: str,
    step: int,
    model: str,
    version: str,
    handler: Path,
    extra_files: Sequence[Path] = (),
    store: Path,
    part: str = "model",
) -> Artifact:
    if not VERSION_NAME.match(model) or not VERSION_NAME.match(version):
        raise ConfigError(f"model {model!r} / version {version!r}: use letters, digits, '.', '_' or '-'")
    for f in (handler, *extra_files):
        if not f.is_file():
            raise ConfigError(f"{f} does not exist")
    target = store / archive_name(model, version)
    if target.exists():
        raise ConfigError(f"{target} already exists; versions are never overwritten")
    ck, weights = verified_weights(cat, run, step, part)
    origin = {"run": run, "step": step, "checkpoint_id": ck.id, "manifest_digest": ck.manifest_digest}

    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store, prefix=".export-") as tmp:
        work = Path(tmp)
        save_file(weights, str(work / WEIGHTS), metadata={k: str(v) for k, v in origin.items()})
        (work / LINEAGE).write_text(json.dumps({"model": model, "version": version, **origin}, indent=1))
        extras = [str(work / LINEAGE), *(str(f) for f in extra_files)]
        _archive(model, version, work / WEIGHTS, handler, extras, work)
        try:
            os.link(work / f"{model}.mar", target)  # fails rather than overwrite
        except FileExistsError:
            raise ConfigError(f"{target} was created meanwhile; versions are never overwritten") from None
    d = hash_file(target, with_crc=False)
    return Artifact(model, version, target, d.xxh3, d.size, ck.id, run, step, ck.manifest_digest or "")


def verified_weights(
    cat: Catalog, run: str, step: int, part: str = "model"
) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """The tensors of ``part`` of the verified checkpoint ``run@step``, through the one restore path: the
    nearest copy held to the catalog's digest, every byte checked as it is read."""
    ck = verified_checkpoint(cat, run, step)
    p = plan.plan(cat, run, root=config.checkpoint_root(), checkpoint_id=ck.id)
    return ck, execute.execute(cat, p, lambda d, m: _weights(d, m, part, f"{run}@{step}")).value


def _weights(directory: Path, manifest: mf.Manifest, part: str, name: str) -> dict[str, torch.Tensor]:
    """The tensors of ``part``, read from a copy whose manifest matched the catalog's record, every byte
    hashed as it is read. An adopted checkpoint is read as its own format, never as Rewind's."""
    fmt = payload.adopted_format(manifest)
    if fmt is not None:
        return _adopted_weights(directory, manifest, fmt, part, name)
    states = payload.read_states(directory, manifest)
    if part not in states:
        raise ConfigError(f"checkpoint {name} has no {part!r} state (it has {sorted(states)})")
    weights = {
        k: v.detach().clone().contiguous() for k, v in states[part].items() if isinstance(v, torch.Tensor)
    }
    if not weights:
        raise ConfigError(f"the {part!r} state of {name} holds no tensors")
    return weights


def _adopted_weights(
    directory: Path, manifest: mf.Manifest, fmt: str, part: str, name: str
) -> dict[str, torch.Tensor]:
    """The model of an adopted HF Trainer or safetensors checkpoint: ``model.safetensors`` (or its shards
    ``model-NNNNN-of-NNNNN.safetensors``; else the one ``.safetensors`` file there is). Nothing is written
    into the directory (it is the user's), and what Rewind's reader cannot take from it (a dtype it lacks,
    weights only as pickles) is a refusal of the export, never a verdict on the checkpoint. Every other file
    is hashed too, so the copy the executor then records as verified is verified."""
    if fmt not in ADOPTED_EXPORTABLE:
        raise ConfigError(
            f"checkpoint {name} is an adopted {fmt} checkpoint: export takes Rewind's own, "
            f"and adopted {' or '.join(ADOPTED_EXPORTABLE)} checkpoints"
        )
    if part != "model":
        raise ConfigError(
            f"checkpoint {name} is an adopted {fmt} checkpoint: it holds the model only, not {part!r}"
        )
    top = [e for e in manifest.files if "/" not in e.path and e.path.endswith(".safetensors")]
    chosen = [e for e in top if _HF_WEIGHTS.fullmatch(e.path)] or (top if len(top) == 1 else [])
    if not chosen:
        raise ConfigError(
            f"checkpoint {name} (adopted {fmt}) has no model.safetensors to export "
            f"(its safetensors files: {', '.join(e.path for e in top) or 'none'})"
        )
    rest = tuple(e for e in manifest.files if e not in chosen)
    verify_files(directory, dataclasses.replace(manifest, files=rest))
    weights: dict[str, torch.Tensor] = {}
    for entry in chosen:
        try:
            tensors = payload.read_tensors(directory, entry)
        except UnloadableCheckpoint as exc:  # its bytes are the ones adopted: Rewind's reader is what fails
            raise ConfigError(f"checkpoint {name}: cannot export {entry.path}: {exc}") from exc
        if weights.keys() & tensors.keys():
            raise ConfigError(f"checkpoint {name}: {entry.path} repeats tensors of another weights file")
        weights.update(tensors)
    if not weights:
        raise ConfigError(f"checkpoint {name}: {', '.join(e.path for e in chosen)} holds no tensors")
    return weights


def _archive(model: str, version: str, weights: Path, handler: Path, extras: list[str], out: Path) -> None:
    tool = program("torch-model-archiver", "pip install torch-model-archiver")
    cmd = [
        tool, "--model-name", model, "--version", version, "--serialized-file", str(weights),
        "--handler", str(handler), "--extra-files", ",".join(extras), "--export-path", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ConfigError(f"torch-model-archiver failed: {(done.stderr or done.stdout).strip()[-500:]}")
