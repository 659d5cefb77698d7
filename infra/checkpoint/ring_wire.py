"""The peer ring's wire: one host's files streamed to the next host's leader in fixed-size pieces, over a
gloo process group, while the previous host's arrive; each received file hashed as it is written and kept
only when it is its manifest entry. Nothing here raises for a file: a file that cannot be read is sent as
zeros (no receiver keeps it), one that cannot be written is dropped, and every piece is still exchanged, so
that no peer ever waits on a message that will not come. At most two pieces are in memory per leader."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import Hasher

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


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


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
            if f.readinto(_bytes(out)) != piece.length:
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
            view = _bytes(data)
            self._open[2].update(view)
            self._open[1].write(view)
            if piece.last:
                self._finish(e)
        except Exception as exc:  # this file is lost; the pieces still come and are let go
            self._failed.add(e.path)
            self.errors.append(f"{e.path}: {exc}")
            self.close()

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
            self._open[1].close()
            self._open = None


def exchange(
    directory: Path,
    outgoing: list[mf.FileEntry],
    incoming: list[mf.FileEntry],
    target: Path,
    peers: tuple[int, int],
    group: dist.ProcessGroup | None,
) -> tuple[int, int, list[str]]:
    """Send ``outgoing`` (files of ``directory``) to the next leader while the previous one's ``incoming``
    are written into ``target``; (bytes sent, bytes kept, errors). Collective between the two peers."""
    prev, nxt = peers
    send, recv = pieces(outgoing), pieces(incoming)
    sbuf = torch.empty(max((p.length for p in send), default=0), dtype=torch.uint8)
    rbuf = torch.empty(max((p.length for p in recv), default=0), dtype=torch.uint8)
    reader, writer = Reader(directory), Writer(target)
    for e in incoming:
        if not e.size:
            _empty(writer, e)
    for i in range(max(len(send), len(recv))):
        work = None
        if i < len(send):
            out = sbuf[: send[i].length]
            reader.fill(send[i], out)
            work = dist.isend(out, dst=nxt, group=group)
        if i < len(recv):
            got = rbuf[: recv[i].length]
            dist.recv(got, src=prev, group=group)
            writer.take(recv[i], got)
        if work is not None:
            work.wait()
    reader.close()
    writer.close()
    sent = sum(e.size for e in outgoing if e.path not in reader.failed)
    return sent, writer.kept, writer.errors


def _empty(writer: Writer, entry: mf.FileEntry) -> None:
    try:
        writer.empty(entry)
    except Exception as exc:
        writer.errors.append(f"{entry.path}: {exc}")
        writer.close()
