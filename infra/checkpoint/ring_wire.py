"""The peer ring's wire: one host's files streamed to the next host's leader in fixed-size pieces, over a
gloo process group, while the previous host's arrive; each received file hashed as it is written and kept
only when it is its manifest entry. Nothing here raises for a file: a file that cannot be read is sent as
zeros (no receiver keeps it), one that cannot be written is dropped, and every piece is still exchanged, so
that no peer ever waits on a message that will not come. At most two pieces are in memory per leader (and,
keeping its own files, one file of those every disk holds: DCP's metadata, the shared state).

A leader may keep its own share beside the peer's (``own``): each outgoing piece, once read, is written into
the ring copy too, hashed like a received one, so the share is read from the disk once for both; the files
every disk holds (no share's) are copied in whole. A file of its own that does not prove is dropped alone:
the peer's share does not depend on it."""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from rewind.infra.format import manifest as mf
from rewind.infra.format import tensorfile
from rewind.infra.format.digest import Hasher, hash_bytes

log = logging.getLogger("rewind.ring")
PIECE = 16 << 20  # bytes per message


@dataclass(frozen=True, slots=True)
class Piece:
    entry: mf.FileEntry
    offset: int
    length: int

    @property
    def last(self) -> bool:
        return self.offset + self.length == self.entry.size


def pieces(entries: list[mf.FileEntry]) -> list[Piece]:
    """The messages that carry ``entries`` (empty files carry none)."""
    return [Piece(e, o, min(PIECE, e.size - o)) for e in entries for o in range(0, e.size, PIECE)]


@dataclass
class Reader:
    """Fills each outgoing piece from the committed copy's files."""

    directory: Path
    _open: tuple[str, io.BufferedReader] | None = None
    failed: set[str] = field(default_factory=set)

    def fill(self, piece: Piece, out: torch.Tensor) -> None:
        try:
            f = self._file(piece.entry)
            f.seek(piece.offset)
            if f.readinto(tensorfile.byte_view(out)) != piece.length:
                raise OSError("shorter than the manifest says")
        except Exception as exc:  # zeros: the receiver's hash refuses them
            if piece.entry.path not in self.failed:
                log.warning("%s not sent round the ring: %s", piece.entry.path, exc)
            self.failed.add(piece.entry.path)
            out.zero_()

    def _file(self, entry: mf.FileEntry) -> io.BufferedReader:
        if self._open is None or self._open[0] != entry.path:
            self.close()
            self._open = (entry.path, open(self.directory / mf.safe_relative(entry.path), "rb"))  # noqa: SIM115
        return self._open[1]

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None


@dataclass
class Writer:
    """Writes each incoming piece into the ring copy, hashing it; a file is kept when its last piece proves it."""

    target: Path
    errors: list[str] = field(default_factory=list)
    kept: int = 0
    _open: tuple[str, io.BufferedWriter, Hasher] | None = None
    _failed: set[str] = field(default_factory=set)

    def take(self, piece: Piece, data: torch.Tensor) -> None:
        e = piece.entry
        if e.path in self._failed:
            return
        try:
            if piece.offset == 0:
                self._start(e)
            assert self._open is not None and self._open[0] == e.path
            view = tensorfile.byte_view(data)
            self._open[2].update(view)
            self._open[1].write(view)
            if piece.last:
                self._finish(e)
        except Exception as exc:  # this file is lost; the pieces still come and are let go
            self._failed.add(e.path)
            self.errors.append(f"{e.path}: {exc}")
            with contextlib.suppress(OSError):  # a close that fails (a full filesystem) is this file's loss
                self.close()
            with contextlib.suppress(OSError):  # never left as if kept
                (self.target / mf.safe_relative(e.path)).unlink()

    def empty(self, entry: mf.FileEntry) -> None:
        self._start(entry)
        self._finish(entry)

    def _start(self, entry: mf.FileEntry) -> None:
        self.close()
        path = self.target / mf.safe_relative(entry.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._open = (entry.path, open(path, "xb"), Hasher(with_crc=False))  # noqa: SIM115

    def _finish(self, entry: mf.FileEntry) -> None:
        assert self._open is not None
        got = self._open[2].result()
        self.close()
        if (got.size, got.xxh3) != (entry.size, entry.xxh3):
            raise OSError("as received differs from the manifest's entry")
        self.kept += entry.size

    def close(self) -> None:
        if self._open is not None:
            f, self._open = self._open[1], None
            f.close()


@dataclass(frozen=True, slots=True)
class Exchanged:
    """What one leader's exchange did: bytes sent, the peer's bytes kept, the failures keeping them (the
    ring copy is then not made) and the bytes of its own share kept beside them."""

    sent: int
    received: int
    errors: tuple[str, ...]
    own: int = 0


def exchange(
    directory: Path,
    outgoing: list[mf.FileEntry],
    incoming: list[mf.FileEntry],
    target: Path,
    peers: tuple[int, int],
    group: dist.ProcessGroup | None,
    *,
    own: list[mf.FileEntry] | None = None,
) -> Exchanged:
    """Send ``outgoing`` (files of ``directory``) to the next leader while the previous one's ``incoming``
    are written into ``target``, and ``own`` (this disk's files: ``outgoing`` and those every disk holds)
    kept there too when given. Collective between the two peers."""
    prev, nxt = peers
    send, recv = pieces(outgoing), pieces(incoming)
    sbuf = torch.empty(max((p.length for p in send), default=0), dtype=torch.uint8)
    rbuf = torch.empty(max((p.length for p in recv), default=0), dtype=torch.uint8)
    reader, writer = Reader(directory), Writer(target)
    mirror = Writer(target) if own is not None else None
    for e in incoming:
        if not e.size:
            _empty(writer, e)
    for i in range(max(len(send), len(recv))):
        work = None
        if i < len(send):
            out = sbuf[: send[i].length]
            reader.fill(send[i], out)
            work = dist.isend(out, dst=nxt, group=group)
            if mirror is not None:  # read once: kept here while it travels
                mirror.take(send[i], out)
        if i < len(recv):
            got = rbuf[: recv[i].length]
            dist.recv(got, src=prev, group=group)
            writer.take(recv[i], got)
        if work is not None:
            work.wait()
    reader.close()
    writer.close()
    sent = sum(e.size for e in outgoing if e.path not in reader.failed)
    kept_own = _keep_own(directory, target, mirror, own or [], {e.path for e in outgoing})
    return Exchanged(sent, writer.kept, tuple(writer.errors), kept_own)


def _keep_own(
    directory: Path, target: Path, mirror: Writer | None, own: list[mf.FileEntry], sent: set[str]
) -> int:
    """This disk's own files kept in the ring copy: those sent (already written by ``mirror``) and the
    ones every disk holds, copied whole and proven; the bytes kept. A file that fails is left out, logged."""
    if mirror is None:
        return 0
    with contextlib.suppress(OSError):  # nothing is open after a file's last piece: a failing close never
        mirror.close()  # costs the peer's share
    for e in own:
        if e.path in sent and not e.size:
            _empty(mirror, e)
        elif e.path not in sent:
            _copy_proven(directory, target, e, mirror)
    if mirror.errors:
        log.warning(
            "%d of this host's own files not kept in its memory: %s", len(mirror.errors), mirror.errors[0]
        )
    return mirror.kept


def _copy_proven(directory: Path, target: Path, entry: mf.FileEntry, mirror: Writer) -> None:
    path = target / mf.safe_relative(entry.path)
    try:
        raw = (directory / mf.safe_relative(entry.path)).read_bytes()
        got = hash_bytes(raw)
        if (got.size, got.xxh3) != (entry.size, entry.xxh3):
            raise OSError("on this disk differs from the manifest's entry")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as f:
            f.write(raw)
        mirror.kept += entry.size
    except Exception as exc:
        mirror.errors.append(f"{entry.path}: {exc}")
        if not isinstance(exc, FileExistsError):  # never left as if kept; never raised (the peer's share)
            with contextlib.suppress(OSError):
                path.unlink()


def _empty(writer: Writer, entry: mf.FileEntry) -> None:
    try:
        writer.empty(entry)
    except Exception as exc:
        writer.errors.append(f"{entry.path}: {exc}")
        writer.close()
        if not isinstance(exc, FileExistsError):  # never left as if kept
            with contextlib.suppress(OSError):
                (writer.target / mf.safe_relative(entry.path)).unlink()
