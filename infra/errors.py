"""Error types shared by every layer.

Errors are classified once, here: a ``TransientError`` may succeed when retried
(network blip, database restart, lock timeout); everything else is permanent and
retrying it only hides the problem (corruption, bad credentials, bad input).
Every module raises one of these, never a bare ``ValueError``/``RuntimeError``/``TypeError``:
``is_transient`` is the one decision of what may succeed when retried: task retries
and the CLI's exit codes both ask it (transient: exit 3; any other ``RewindError``:
exit 2; anything else: 70, a bug).
``ConfigError`` and ``MalformedFile`` are also ``ValueError``s, so code written against
the usual Python contract keeps working.
"""

from __future__ import annotations

import errno


class RewindError(Exception):
    """Base class: a clear, one-line message a user can act on."""


class TransientError(RewindError):
    """A fault that may go away by itself; callers may retry."""


class ConfigError(RewindError, ValueError):
    """Bad input from the user: a malformed URL, a missing setting, a bad argument."""


class MalformedFile(RewindError, ValueError):
    """Bytes that do not parse as the format they claim (a hostile or broken file)."""


class Refused(RewindError):
    """An action Rewind will not take however often it is asked (a read-only copy, a spent budget)."""


class Stopped(RewindError):
    """The process was asked to stop (SIGTERM) while it waited: unwind, clean up, exit. Never retried."""


class RankFailed(RewindError):
    """Another rank's part of a collective save or restore failed; the message carries its reason."""


class RunBusy(ConfigError):
    """Another live process is writing this run's checkpoints: two writers would fork its timeline."""


class Fenced(RewindError):
    """This process is no longer the run's writer (its launch ended, or another took over): it must not commit."""


class MissingDatabase(ConfigError):
    """The database server answered, but the catalog's database is not on it (``rewind db upgrade`` creates it)."""


class NotFoundError(RewindError):
    """A run, checkpoint or object that does not exist."""


class CatalogUnavailable(TransientError):
    """The catalog database cannot be reached right now."""


class CorruptCheckpoint(RewindError):
    """A copy of a checkpoint failed verification; never load it."""

    verdict = "is corrupt"

    def __init__(self, location: str, findings: list) -> None:
        self.location = location
        self.findings = findings
        detail = "; ".join(str(f) for f in findings) or "unknown reason"
        super().__init__(f"checkpoint {location} {self.verdict}: {detail}")

    def __reduce__(self) -> tuple:  # survives pickling (DCP gathers exceptions across ranks)
        return (type(self), (self.location, self.findings))


class UnloadableCheckpoint(CorruptCheckpoint):
    """Every byte matched the catalog, yet the content does not decode into (or load into) a state.

    Every copy holds the same bytes, so no other copy can help: the checkpoint itself is bad
    (or, when no checkpoint of the run loads, the job no longer fits its checkpoints).
    """

    verdict = "cannot be loaded"


class StateMismatch(UnloadableCheckpoint):
    """The checkpoint decodes, but the job's state objects refuse it (``load_state_dict`` raised).

    Either the checkpoint is bad or the job changed shape; only an older checkpoint
    that loads tells which, so no checkpoint is condemned on this alone.
    """

    verdict = "does not fit this job"


class NoRestorableCheckpoint(NotFoundError):
    """No checkpoint of a run passed verification; ``skipped`` says what was tried and why it failed."""

    def __init__(self, message: str, skipped: tuple = ()) -> None:
        super().__init__(message)
        self.skipped = skipped

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.skipped))


class CheckpointUnverifiable(TransientError):
    """A checkpoint that may well be good could not be checked right now (I/O error, unknown key).

    Never a reason to start a run over: whoever restores waits, retries, or is told.
    """

    def __init__(self, message: str, skipped: tuple = ()) -> None:
        super().__init__(message)
        self.skipped = skipped

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.skipped))


class ServingUnavailable(TransientError):
    """The model server or the proxy in front of it cannot be reached right now."""


_TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.EBUSY}
)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help: network blips, an unreachable catalog, flaky I/O; never corruption,
    bad input or credentials. Task retries and the CLI's exit codes both decide by this."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, RewindError):
        return False
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS
