"""Moving checkpoints between tiers, verified end to end.

Write order on the target: every data file, then a check that the target holds
exactly the manifest's sizes and checksums, then the manifest, last, as the
commit marker. A target without the manifest holds no checkpoint, whatever else
it holds; a re-run sends only what is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from infra.checkpoint import manifest as mf
from infra.checkpoint import store
from infra.checkpoint.verify import Finding, Problem
from infra.digest import CHUNK, Hasher, hash_bytes
from infra.errors import CorruptCheckpoint
from infra.tiers.base import ObjectNotFound, Tier


def checkpoint_key(run: str, step: int, path: str = "") -> str:
    base = f"{run}/step-{step}"
    return f"{base}/{path}" if path else base


def _stat_matches(tier: Tier, key: str, entry: mf.FileEntry) -> Finding | None:
    try:
        info = tier.stat(key)
    except ObjectNotFound:
        return Finding(Problem.MISSING, entry.path, f"not on the {tier.name} tier")
    if info.size != entry.size:
        return Finding(
            Problem.SIZE, entry.path, f"{tier.name} holds {info.size} bytes, manifest says {entry.size}"
        )
    if info.crc32c is not None and info.crc32c != entry.crc32c:
        return Finding(
            Problem.DIGEST, entry.path, f"{tier.name} crc32c {info.crc32c} != manifest {entry.crc32c}"
        )
    return None


def replicate(
    source: Path, tier: Tier, run: str, *, on_file: Callable[[str, int], None] | None = None
) -> int:
    """Copy a local checkpoint to ``tier``; returns bytes sent (0 when it is already there)."""
    raw = (source / mf.MANIFEST_NAME).read_bytes()
    manifest = mf.parse(raw)
    manifest_key = checkpoint_key(run, manifest.step, mf.MANIFEST_NAME)
    try:
        tier.stat(manifest_key)
        return 0  # committed there already (the manifest goes last)
    except ObjectNotFound:
        pass
    sent = 0
    for e in manifest.files:
        key = checkpoint_key(run, manifest.step, e.path)
        finding = _stat_matches(tier, key, e)
        if finding is None:
            continue
        if finding.problem is not Problem.MISSING:
            tier.delete(key)  # a leftover from an older, different attempt
        sent += tier.put(key, source / e.path, crc32c=e.crc32c)
        if on_file is not None:
            on_file(e.path, sent)
    bad = [
        f for e in manifest.files if (f := _stat_matches(tier, checkpoint_key(run, manifest.step, e.path), e))
    ]
    if bad:
        raise CorruptCheckpoint(f"{tier.uri}/{checkpoint_key(run, manifest.step)}", bad)
    tier.put_bytes(manifest_key, raw, crc32c=hash_bytes(raw).crc32c)
    return sent


def verify_remote(
    tier: Tier, run: str, step: int, manifest_digest: str | None, *, deep: bool
) -> list[Finding]:
    """Check a replica: quick compares sizes and server-side checksums, deep downloads and re-hashes."""
    base = checkpoint_key(run, step)
    try:
        with tier.open(f"{base}/{mf.MANIFEST_NAME}") as f:
            raw = f.read()
    except ObjectNotFound:
        return [
            Finding(
                Problem.MANIFEST, mf.MANIFEST_NAME, f"not on the {tier.name} tier: the copy is incomplete"
            )
        ]
    try:
        manifest = mf.parse(raw)
    except mf.ManifestError as exc:
        return [Finding(Problem.MANIFEST, mf.MANIFEST_NAME, str(exc))]
    findings: list[Finding] = []
    if manifest_digest is not None and hash_bytes(raw).xxh3 != manifest_digest:
        findings.append(
            Finding(Problem.MANIFEST, mf.MANIFEST_NAME, "differs from the catalog's manifest digest")
        )
    for e in manifest.files:
        key = f"{base}/{e.path}"
        if (f := _stat_matches(tier, key, e)) is not None:
            findings.append(f)
        elif deep:
            h = Hasher(with_crc=False)
            with tier.open(key) as body:
                while chunk := body.read(CHUNK):
                    h.update(chunk)
            if h.result().xxh3 != e.xxh3:
                findings.append(
                    Finding(
                        Problem.DIGEST,
                        e.path,
                        f"{tier.name} copy xxh3 {h.result().xxh3} != manifest {e.xxh3}",
                    )
                )
    return findings


def materialize(tier: Tier, run: str, step: int, run_dir: Path) -> tuple[Path, mf.Manifest]:
    """Download a replica into the local tier with the commit protocol; every byte is checked against the manifest."""
    base = checkpoint_key(run, step)
    with tier.open(f"{base}/{mf.MANIFEST_NAME}") as f:
        manifest = mf.parse(f.read())

    def stream(path: str) -> Callable[[BinaryIO], None]:
        def fill(out: BinaryIO) -> None:
            with tier.open(f"{base}/{path}") as body:
                while chunk := body.read(CHUNK):
                    out.write(chunk)

        return fill

    files: Sequence[tuple[str, Callable[[BinaryIO], None]]] = [
        (e.path, stream(e.path)) for e in manifest.files
    ]
    return store.write_checkpoint(run_dir, manifest, files, expect=manifest.files)
