"""Where an async save hashes its files (a chunked save: its chunks and packs): in the stall, on every core, or in the background persist.

``REWIND_HASH_IN_STALL=auto|on|off``. The background persist hashes each file (xxh3 and CRC32C) as it
writes it, on a core the job is not using, if there is one. When the job's torch threads cover every core
this process may run on (CPU training on the whole machine), there is none: the persist's hashing then
runs between the job's threads, and a parallel operator waits for the one thread that lost its core, so
each millisecond of hashing cost the job about two (measured: a 51M-parameter job on both of 2 cores).
``auto`` (the default) then hashes the files in the stall instead, while the job waits: each block copied
into the staging buffer and hashed while in the cache, on every core (``stage_hashed``; a few
milliseconds more stall), and the persist only writes. On a GPU job, or one that
leaves a core free, ``auto`` keeps the hashing in the background; ``on`` and ``off`` force either.

The digests are of the staged bytes, which the write then sends unchanged (the staging buffer is not
reused before the persist ends); the written size is held to the hashed one.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from rewind.infra import cpus
from rewind.infra.checkpoint import stage_chunked, stage_hashed
from rewind.infra.checkpoint.staging import Parts, Staged, StagingBuffer
from rewind.infra.errors import ConfigError
from rewind.infra.format import payload, store

ENV = "REWIND_HASH_IN_STALL"
CHOICES = ("auto", "on", "off")


def configured() -> str:
    """``REWIND_HASH_IN_STALL`` (default ``auto``); a bad value is a one-line ``ConfigError``."""
    raw = os.environ.get(ENV, "").strip().lower() or "auto"
    if raw not in CHOICES:
        raise ConfigError(f"{ENV}={raw!r}: expected one of {', '.join(CHOICES)}")
    return raw


def wanted(parts: Parts) -> bool:
    """Whether a save of ``parts`` hashes in its stall: ``on``; or ``auto`` with the state on the CPU and
    the job's torch threads on every core this process may use (``cpus.cores``: physical cores, at most
    the cgroup's quota)."""
    setting = configured()
    if setting != "auto":
        return setting == "on"
    on_cpu = all(t.device.type == "cpu" for ts in parts.values() for t in ts.values())
    return on_cpu and torch.get_num_threads() >= cpus.cores()


def stage(
    staging: StagingBuffer, parts: Parts, *, fmt: str, all_new: bool
) -> tuple[Staged, payload.Prehashed]:
    """``parts`` staged; and where the job leaves no core to the background persist (``wanted``), their
    digests, computed now on every core: the plain format's files (``stage_and_hash``), or the chunked
    format's chunks, and its packs where ``all_new`` (``stage_chunked``)."""
    if not wanted(parts):
        return staging.stage(parts), payload.Prehashed()
    if fmt == payload.CHUNKED:
        return stage_chunked.stage_and_hash(staging, parts, workers=cpus.usable(), all_new=all_new)
    staged, files = stage_and_hash(staging, parts)
    return staged, payload.Prehashed(files=files)


def behind(
    staged: Parts, prehashed: payload.Prehashed | None, *, fmt: str, all_new: bool
) -> payload.Prehashed | None:
    """What the persist hashes before it lays out the files: a chunked save's chunks not hashed in the stall,
    in one pass with its packs, on as many threads as it writes files at once (the writes then hash nothing
    more); ``prehashed`` as it is otherwise."""
    if fmt != payload.CHUNKED or (prehashed is not None and prehashed.chunks):
        return prehashed
    workers = min(cpus.usable(), store.WRITE_STREAMS)
    return stage_chunked.hash_staged(staged, workers=workers, all_new=all_new)


def stage_and_hash(staging: StagingBuffer, parts: Parts) -> tuple[Staged, dict[str, store.Hashed]]:
    """``parts`` staged, and their plain-format tensor files as written from the staging buffer, hashed:
    copied and hashed in one pass on every core (``stage_hashed``) where a copy of bytes stages them; else
    staged, then hashed one file per core."""
    if stage_hashed.plain(parts):
        return stage_hashed.stage_and_hash(staging, parts, workers=cpus.usable())
    staged = staging.stage(parts)
    staged.ready()
    return staged, hashed(staged.parts)


def hashed(staged: Parts) -> dict[str, store.Hashed]:
    """The plain-format tensor files of ``staged``, each as ``payload.file_writers`` streams it, with its
    digests: the largest first, one file per core at a time."""
    biggest_first = dict(sorted(staged.items(), key=lambda kv: -sum(_nbytes(t) for t in kv[1].values())))
    files = [
        (name, fill)
        for name, fill in payload.file_writers({}, biggest_first)  # nothing prehashed: no ``store.Hashed``
        if name != payload.STATE_FILE and not isinstance(fill, store.Link | store.Hashed)
    ]
    if len(files) <= 1:
        return {name: store.Hashed(fill, store.hash_stream(fill)) for name, fill in files}
    with ThreadPoolExecutor(
        max_workers=min(len(files), cpus.usable()), thread_name_prefix="rewind-hash"
    ) as pool:
        done = {name: (fill, pool.submit(store.hash_stream, fill)) for name, fill in files}
        return {name: store.Hashed(fill, f.result()) for name, (fill, f) in done.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
