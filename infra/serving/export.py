"""Export: a verified checkpoint becomes a TorchServe model archive that knows where it came from.

Only a checkpoint the catalog holds as ``verified`` is exported, and its bytes are
read through the one restore path (the nearest copy held to the catalog's manifest
digest, every byte hashed as it is read), so an archive never carries weights
whose digest did not match the catalog's record. The archive holds ``weights.safetensors`` (one part of the
checkpoint, ``model`` by default), the handler and its files, and ``rewind.json``
with the lineage (run, step, checkpoint id, manifest digest). It is built in a
temporary directory and renamed into the model store; an existing version is
never overwritten.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from infra import config
from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import Checkpoint
from infra.catalog.models import CheckpointStatus as S
from infra.errors import ConfigError, NotFoundError
from infra.format import payload
from infra.format.digest import hash_file
from infra.launch.process import program
from infra.restore import execute, plan
from infra.serving.haproxy import VERSION_NAME

WEIGHTS = "weights.safetensors"
LINEAGE = "rewind.json"


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
    live = [
        c
        for c in lineage.checkpoints(cat, run, step)
        if c.status in (S.COMMITTED, S.VERIFIED, S.WRITING, S.CORRUPT)
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
    ck = verified_checkpoint(cat, run, step)
    target = store / archive_name(model, version)
    if target.exists():
        raise ConfigError(f"{target} already exists; versions are never overwritten")
    # The one restore path: the nearest copy held to the catalog's digest, every byte checked as read.
    p = plan.plan(cat, run, root=config.checkpoint_root(), checkpoint_id=ck.id)
    states = execute.execute(cat, p, payload.read_states).value
    if part not in states:
        raise ConfigError(f"checkpoint {run}@{step} has no {part!r} state (it has {sorted(states)})")
    weights = {
        k: v.detach().clone().contiguous() for k, v in states[part].items() if isinstance(v, torch.Tensor)
    }
    if not weights:
        raise ConfigError(f"the {part!r} state of {run}@{step} holds no tensors")
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


def _archive(model: str, version: str, weights: Path, handler: Path, extras: list[str], out: Path) -> None:
    tool = program("torch-model-archiver", "pip install torch-model-archiver")
    cmd = [
        tool, "--model-name", model, "--version", version, "--serialized-file", str(weights),
        "--handler", str(handler), "--extra-files", ",".join(extras), "--export-path", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ConfigError(f"torch-model-archiver failed: {(done.stderr or done.stdout).strip()[-500:]}")
