"""A tiny LM handler that answers well until its flag file appears, then wrongly (still HTTP 200):
a version that passes its canary and goes bad after promotion, for the post-promotion gates to catch.

The flag is ``$TMPDIR/rewind-turns-bad-<version>`` (the serving stack gives TorchServe a private
``tmp/``): the test that deploys the version creates it.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from tiny_lm_handler import TinyLMHandler


class TurnsBadHandler(TinyLMHandler):
    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        flag = os.path.join(tempfile.gettempdir(), f"rewind-turns-bad-{self.version}")
        if not os.path.exists(flag):
            return super().handle(data, context)
        return [json.dumps({"output": "\x00", "version": self.version}) for _ in data]
