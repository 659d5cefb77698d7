"""Error types shared by every layer.

Errors are classified once, here: a ``TransientError`` may succeed when retried
(network blip, database restart, lock timeout); everything else is permanent and
retrying it only hides the problem (corruption, bad credentials, bad input).
"""

from __future__ import annotations


class RewindError(Exception):
    """Base class: a clear, one-line message a user can act on."""


class TransientError(RewindError):
    """A fault that may go away by itself; callers may retry."""


class ConfigError(RewindError):
    """Bad input from the user: a malformed URL, a missing setting, a bad argument."""


class NotFoundError(RewindError):
    """A run, checkpoint or object that does not exist."""


class CatalogUnavailable(TransientError):
    """The catalog database cannot be reached right now."""


class CorruptCheckpoint(RewindError):
    """A checkpoint failed verification; never load it."""

    def __init__(self, location: str, findings: list) -> None:
        self.location = location
        self.findings = findings
        detail = "; ".join(str(f) for f in findings) or "unknown reason"
        super().__init__(f"checkpoint {location} is corrupt: {detail}")


class NoRestorableCheckpoint(NotFoundError):
    """No checkpoint of a run passed verification."""


class ServingUnavailable(TransientError):
    """The model server or the proxy in front of it cannot be reached right now."""
