"""What a node's first rank tells its host's memory agent (``host_agent``) after each commit: a line on the
agent's FIFO, named by ``REWIND_HOST_AGENT`` in the job's environment.

The agent opens the FIFO for reading only once it has met the other hosts' agents, so a FIFO with a reader
is an agent ready to pass (``agent``); beside the FIFO it names, per run, the commit it last finished passing
(``passed``), which a rank closing its checkpointer (or loading) waits for while the agent listens. Telling
never waits for the agent and is never failed by it: the FIFO is opened without blocking, a line is at most
``PIPE_BUF`` bytes (written whole or not at all), and a full FIFO (an agent that stopped reading) drops the
line with a warning. The agent holds nothing it is told
to be true: the pass proves every file against the committed manifest it reads from its own disk.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path

log = logging.getLogger("rewind.ring")
FIFO_ENV = "REWIND_HOST_AGENT"
PASSED = "passed"  # beside the FIFO: per run, the id of the commit the agent last finished passing
MAX_LINE = 4096  # PIPE_BUF on Linux: a write of at most this many bytes is never interleaved with another


@dataclass(frozen=True, slots=True, kw_only=True)
class Committed:
    """A checkpoint committed on this host's disk: the run, its step and directory here, the disk (its id and
    host) and, told by rank 0 alone, the catalog's checkpoint id and the catalog's address (its password
    too: the FIFO is this user's alone; never shown, never sent on to another host)."""

    run: str
    step: int
    directory: str
    disk: str
    host: str
    id: str = ""  # the teller's own name for this word: the agent says which it last finished (``passed``)
    checkpoint_id: int | None = None
    # the committed manifest's (rank 0's word): a ring copy of another checkpoint is not recorded as this one
    digest: str | None = None
    catalog: str | None = field(default=None, repr=False)

    def line(self) -> bytes:
        return (json.dumps(asdict(self), separators=(",", ":")) + "\n").encode()

    def shareable(self) -> Committed:
        """What another host's agent may see of it: no catalog address."""
        return replace(self, catalog=None)


def present() -> bool:
    """Whether this process was started under a host memory agent."""
    return bool(os.environ.get(FIFO_ENV, "").strip())


class Agent(StrEnum):
    """This host's memory agent as its FIFO shows it."""

    LISTENING = "listening"  # the FIFO has a reader: the agent met the others and is ready
    STARTING = "starting"  # the FIFO is there without a reader yet: the agent is meeting the others
    GONE = "gone"  # no FIFO (the agent ended and took it along), or none was ever named


def agent() -> Agent:
    """This host's memory agent's state (never blocks, never raises)."""
    where = os.environ.get(FIFO_ENV, "").strip()
    if not where:
        return Agent.GONE
    try:
        fd = os.open(where, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        return Agent.STARTING if exc.errno == errno.ENXIO else Agent.GONE
    os.close(fd)
    return Agent.LISTENING


def passed(run: str) -> str | None:
    """The id of ``run``'s commit this host's agent last finished passing, if any."""
    where = os.environ.get(FIFO_ENV, "").strip()
    try:
        done = json.loads((Path(where).parent / PASSED).read_text(encoding="utf-8")) if where else {}
    except (OSError, ValueError, RecursionError):
        return None
    got = done.get(run) if isinstance(done, dict) else None
    return got if isinstance(got, str) else None


def record_passed(fifo: Path, done: dict[str, str]) -> None:
    """The agent: the id of each run's commit it last finished passing (whole or not at all: written beside,
    then renamed)."""
    tmp = fifo.parent / f".{PASSED}"
    tmp.write_text(json.dumps(done), encoding="utf-8")
    os.replace(tmp, fifo.parent / PASSED)


def tell(notice: Committed) -> bool:
    """Tell this host's memory agent of a commit; whether the line was written. Never blocks, never raises."""
    raw = notice.line()
    if len(raw) > MAX_LINE and notice.catalog is not None:
        log.warning("%s step %d: the catalog's address is too long to tell the memory agent: the ring copies "
                    "are not recorded", notice.run, notice.step)  # fmt: skip
        raw = replace(notice, catalog=None).line()
    if len(raw) > MAX_LINE:
        log.warning("%s step %d: the memory agent not told: the directory's name is too long", notice.run,
                    notice.step)  # fmt: skip
        return False
    try:
        fd = os.open(os.environ.get(FIFO_ENV, "").strip(), os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:  # the agent ended since it was last seen listening
        log.warning("%s step %d: the memory agent not told: %s", notice.run, notice.step, exc)
        return False
    try:
        os.write(fd, raw)
        return True
    except OSError as exc:  # EAGAIN: the agent stopped reading
        log.warning("%s step %d: the memory agent not told: %s", notice.run, notice.step, exc)
        return False
    finally:
        os.close(fd)


class Inbox:
    """The agent's end of the FIFO: the notices as they come, never blocking longer than asked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        # a writer of its own: the FIFO never reads as ended between two ranks' writes
        self._keep = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        self._pending = b""

    def take(self, timeout_s: float) -> list[Committed]:
        """The notices that arrived, waiting at most ``timeout_s`` for the first."""
        if not select.select([self._fd], [], [], timeout_s)[0]:
            return []
        try:
            self._pending += os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return []
        *lines, self._pending = self._pending.split(b"\n")
        if len(self._pending) > MAX_LINE:  # no notice is this long: the rest of that line is dropped unread
            log.warning("a line on the memory agent's FIFO longer than %d bytes: dropped", MAX_LINE)
            self._pending = b""
        return [n for n in map(parsed, lines) if n is not None]

    def close(self) -> None:
        for fd in (self._fd, self._keep):
            os.close(fd)


_TYPES: dict[str, type | tuple[type, ...]] = {"run": str, "step": int, "directory": str, "disk": str, "host": str, "id": str,
          "checkpoint_id": (int, type(None)), "digest": (str, type(None)), "catalog": (str, type(None))}  # fmt: skip


def parsed(line: bytes) -> Committed | None:
    """The notice a line holds; None (told) for a line that is not one, whoever wrote it."""
    try:
        got = json.loads(line)
        if not isinstance(got, dict) or set(got) - {f.name for f in fields(Committed)}:
            raise ValueError("not a commit's fields")
        for name, kind in _TYPES.items():
            value = got.get(name)
            if isinstance(value, bool) or not isinstance(value, kind):  # bool is an int to isinstance
                raise ValueError(f"its {name} is not of the right type")
        return Committed(**got)
    except (ValueError, TypeError, RecursionError) as exc:  # never acted on
        log.warning("a line on the memory agent's FIFO that is not a commit: %s", exc)
        return None
