"""Taking a checkpoint directory Rewind did not write under protection, without rewriting it.

Every file is hashed and a Rewind manifest is written beside them (last, like a
save's), then the checkpoint is registered: from then on verify, replicate,
retain and restore treat it like any other. Nothing in the directory is opened
as anything but bytes here: pickled files (DCP's ``.metadata``, HF Trainer's
``optimizer.pt``, ``rng_state.pth``) are only read, at restore, after their
digests matched. Adopted checkpoints are pinned: retention never deletes a
directory Rewind did not write.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from rewind.infra.catalog import copies, disks, imported, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint.state import writer
from rewind.infra.errors import ConfigError
from rewind.infra.format import manifest as mf
from rewind.infra.format import store
from rewind.infra.format.digest import hash_file, manifest_digest
from rewind.infra.format.verify import check_copy
from rewind.infra.inventory.scan import MAX_STEP

log = logging.getLogger("rewind.adopt")
FORMATS = ("dcp", "torchtitan", "hf-trainer", "safetensors")
_STEP_NAME = re.compile(r"(?:step|checkpoint|global_step|iter)[-_]?(\d{1,19})")
_DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")


@dataclass(frozen=True, slots=True)
class Adopted:
    run: str
    step: int
    format: str
    path: str
    checkpoint_id: int
    files: int
    bytes: int
    digest: str
    action: str  # "adopted" | "already adopted"


def detect(path: Path) -> str:
    """The checkpoint's format from what the directory holds."""
    names = {p.name for p in path.iterdir()}
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return "torchtitan" if re.fullmatch(r"step-\d+", path.name) else "dcp"
    if "trainer_state.json" in names:
        return "hf-trainer"
    if any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    raise ConfigError(f"{path} is not a DCP, TorchTitan, HF Trainer or safetensors checkpoint: give --format")


def checked_step(value: object, source: str) -> int:
    """``value`` as a step the catalog and a manifest hold (an int from 0 to 2**63-1), else a ``ConfigError``."""
    if type(value) is not int or not 0 <= value <= MAX_STEP:
        raise ConfigError(f"{source} gives step {str(value)[:40]!r}, not a whole number from 0 to {MAX_STEP}")
    return value


def step_of(path: Path, fmt: str) -> int:
    """The step a directory's name or HF Trainer's own state says it holds."""
    m = _STEP_NAME.fullmatch(path.name)
    if m:
        return checked_step(int(m.group(1)), f"the name of {path}")
    if fmt == "hf-trainer":
        try:
            found = json.loads((path / "trainer_state.json").read_text())["global_step"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read global_step from {path}/trainer_state.json: {exc}") from exc
        return checked_step(found, f"{path}/trainer_state.json")
    raise ConfigError(f"cannot tell which step {path} holds from its name: give --step")


def _entries(path: Path) -> tuple[mf.FileEntry, ...]:
    """Every regular file below ``path``, hashed; links and special files are refused, not followed."""
    out = []
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            raise ConfigError(f"{p} is a link or special file: adopt only directories of regular files")
        if p.is_file() and rel != mf.MANIFEST_NAME:
            out.append(_hashed(p, rel))
    if not out:
        raise ConfigError(f"{path} holds no files")
    now = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {mf.MANIFEST_NAME}
    if now != {e.path for e in out}:
        raise ConfigError(
            f"{path} changed while it was adopted (files came or went): adopt it when its writer is done"
        )
    return tuple(out)


def _hashed(p: Path, rel: str) -> mf.FileEntry:
    """One file's entry; a file written to while it was hashed is refused (its digest would be of no state)."""
    try:
        before = p.stat()
        d = hash_file(p)
        after = p.stat()
    except PermissionError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror}") from exc
    same = (before.st_ino, before.st_size, before.st_mtime_ns) == (
        after.st_ino,
        after.st_size,
        after.st_mtime_ns,
    )
    if not same or d.size != after.st_size:
        raise ConfigError(f"{p} changed while it was hashed: adopt the directory when its writer is done")
    return mf.FileEntry(_listable(p, rel), d.size, d.xxh3, d.crc32c)


def _listable(p: Path, rel: str) -> str:
    """``rel`` as a manifest lists it; a name no manifest can list is a ``ConfigError`` saying why."""
    if PurePosixPath(rel).name == mf.MANIFEST_NAME:
        raise ConfigError(f"{p} has the name of Rewind's manifest: adopt a copy of the directory without it")
    try:
        rel.encode()
    except UnicodeEncodeError:
        raise ConfigError(
            f"{p!r} has a name that is not UTF-8, which a manifest cannot list: rename it"
        ) from None
    try:
        return mf.safe_relative(rel)
    except mf.ManifestError as exc:
        raise ConfigError(f"cannot adopt {p}: {exc}") from exc


def _world(fmt: str, files: tuple[mf.FileEntry, ...]) -> int:
    ranks = {int(m.group(1)) for f in files if (m := _DCP_SHARD.fullmatch(f.path))}
    return max(len(ranks), 1) if fmt in ("dcp", "torchtitan") else 1


def _write_manifest(path: Path, raw: bytes) -> None:
    if not os.access(path, os.W_OK):
        raise ConfigError(
            f"{path} is read-only: Rewind writes its manifest beside the files; copy the directory "
            "somewhere writable (or make it writable) and adopt that"
        )
    with open(path / mf.MANIFEST_NAME, "xb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    store.fsync_dir(path)


def _parent(cat: Catalog, run_id: int, step: int) -> tuple[int | None, str | None]:
    older = [c for c in lineage.restorable(cat, run_id) if c.step < step]
    return (older[0].step, older[0].manifest_digest) if older else (None, None)


def _register(
    cat: Catalog, run_id: int, m: mf.Manifest, digest: str, path: Path, pin: bool
) -> tuple[int, str]:
    """One transaction for the checkpoint, its copy and its pin; a retry completes what a failed one left."""
    copy = imported.FirstCopy(copies.LOCAL, str(path), None, R.VERIFIED)
    known = imported.by_digest(cat, run_id, digest)
    if known is None:
        ck_id = imported.insert(cat, run_id, m, digest=digest, path=str(path), copy=copy, pinned=pin)
        action = "adopted"
    else:
        ck_id, action = known.id, "already adopted"
        if not any(
            disks.same_copy(r, copies.LOCAL, str(path)) for r in copies.copies_of(cat, [ck_id])[ck_id]
        ):
            copies.add(cat, ck_id, copies.LOCAL, str(path), key=None, nbytes=m.total_bytes, status=R.VERIFIED)
        if pin and not known.pinned:
            imported.pin(cat, ck_id)
    imported.link_parents(cat, run_id, {ck_id: (m.parent_step, m.parent_digest)})
    return ck_id, action


def _existing(path: Path, run: str) -> tuple[mf.Manifest, str] | None:
    """A manifest an earlier adoption wrote here (it proves itself again), or None when there is none."""
    if not (path / mf.MANIFEST_NAME).exists():
        return None
    with open(path / mf.MANIFEST_NAME, "rb") as f:
        raw = mf.read_bounded(f)
    report = check_copy(path, manifest_digest(raw), deep=True)
    m = report.manifest
    if not report.ok or m is None or not m.writer.get("engine", "").startswith("adopted:") or m.run != run:
        raise ConfigError(
            f"{path} already holds a {mf.MANIFEST_NAME} that is not this run's adoption (another tool's file, "
            "another run's adoption, or a Rewind copy: for that, `rewind catalog rebuild --from` on its tier)"
        )
    return m, manifest_digest(raw)


def adopt(
    cat: Catalog,
    path: Path,
    *,
    run: str,
    step: int | None = None,
    fmt: str | None = None,
    owned: bool = False,
) -> Adopted:
    """Hash, write the manifest, register. Running it again on the same directory changes nothing.

    A directory another tool keeps is pinned (retention never deletes it). ``owned``: one Rewind took
    over into its own tier (``rewind.integrations.transformers``): not pinned, its manifest says
    ``owner: rewind``, and retention, gc and quarantine treat it as Rewind's own.
    """
    pin = not owned
    path = path.expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory")
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    run_id = lineage.ensure_run(cat, run)
    again = _existing(path, run)
    if again is not None:
        m, digest = again
    else:
        fmt = fmt or detect(path)
        if fmt in COMPLETE and not (path / COMPLETE[fmt]).is_file():
            raise ConfigError(
                f"{path} has no {COMPLETE[fmt]}, which its writer writes last: adopt it when done"
            )
        at = checked_step(step, "--step") if step is not None else step_of(path, fmt)
        files = _entries(path)
        parent_step, parent_digest = _parent(cat, run_id, at)
        m = mf.Manifest(
            run=run,
            step=at,
            files=files,
            parent_step=parent_step,
            parent_digest=parent_digest,
            created_at=datetime.now(UTC).isoformat(),
            layout={"world_size": _world(fmt, files), "tp": 1, "pp": 1, "dp": _world(fmt, files)},
            writer={**writer(f"adopted:{fmt}"), **({"owner": store.OWNER} if owned else {})},
        )
        raw = m.to_bytes()
        try:
            _write_manifest(path, raw)
        except FileExistsError:  # another adoption of this directory got there first: take its result
            return adopt(cat, path, run=run, owned=owned)
        digest = manifest_digest(raw)
    ck_id, action = _register(cat, run_id, m, digest, path, pin)
    kind = m.writer.get("engine", "adopted:?").removeprefix("adopted:")
    return Adopted(run, m.step, kind, str(path), ck_id, len(m.files), m.total_bytes, digest, action)


COMPLETE = {"hf-trainer": "trainer_state.json", "dcp": ".metadata", "torchtitan": ".metadata"}


def ready(path: Path, *, quiet_s: float) -> bool:
    """Is a directory that appeared under a watched path a finished checkpoint? Its writer's last file
    (HF Trainer's ``trainer_state.json``, DCP's ``.metadata``) is there and nothing changed for
    ``quiet_s`` seconds. A directory of safetensors alone has no such marker: adopt it by hand."""
    try:
        marker = COMPLETE.get(detect(path))
        newest = max((p.stat().st_mtime for p in path.rglob("*")), default=0.0)
    except (ConfigError, OSError):
        return False
    return marker is not None and (path / marker).is_file() and time.time() - newest >= quiet_s


def pending(cat: Catalog, root: Path, *, run: str, pattern: str, quiet_s: float) -> list[Path]:
    """Finished checkpoint directories under ``root`` (matching ``pattern``) not yet in the catalog, oldest
    step first; a directory whose adoption wrote its manifest but died before registering is one of them."""
    if not root.is_dir():
        return []
    run_id = lineage.ensure_run(cat, run)
    inside = root.resolve()
    out = []
    for p in root.glob(pattern):
        if p.is_symlink() or not p.resolve().is_relative_to(inside):  # adoption writes a manifest into it
            log.warning("%s is a link to %s, outside %s: not adopted", p, p.resolve(), root)
            continue
        if not p.is_dir() or not ready(p, quiet_s=quiet_s):
            continue
        if (p / mf.MANIFEST_NAME).exists():
            try:
                with open(p / mf.MANIFEST_NAME, "rb") as f:
                    if imported.by_digest(cat, run_id, manifest_digest(mf.read_bounded(f))) is not None:
                        continue
            except (OSError, mf.ManifestError):
                continue  # not ours to repair here: `rewind adopt` on it says what is wrong
        out.append(p)
    return sorted(out, key=lambda p: (len(p.name), p.name))
