"""A tiny LM handler that fails every third request: a version with a bug the error-rate gate must catch."""

from __future__ import annotations

from typing import Any

from tiny_lm_handler import TinyLMHandler


class FlakyHandler(TinyLMHandler):
    calls = 0

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        self.calls += 1
        if self.calls % 3 == 0:
            raise RuntimeError("injected failure")
        return super().handle(data, context)
