"""The CLI's notifier: log lines (``REWIND_LOG_LEVEL=INFO`` shows them); where a Prefect server is
configured (``PREFECT_API_URL``), events also go there, so a command announces what it found
exactly as the flow doing the same thing would, and the same automations see it."""

from __future__ import annotations

import os

from rewind.infra.phases.notify import Event, LogNotifier


class CliNotifier(LogNotifier):
    def event(self, event: Event) -> None:
        super().event(event)
        if os.environ.get("PREFECT_API_URL"):
            from rewind.tasks.common import PrefectNotifier

            PrefectNotifier().event(event)


def cli_notifier() -> CliNotifier:
    return CliNotifier()
