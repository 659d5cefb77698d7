"""TorchServe handler for the tiny LM: text in, the model's next character out, as JSON.

Packed into a model archive by ``rewind serving deploy`` together with
``tiny_lm_model.py``; TorchServe puts the archive's directory on ``sys.path``.
The architecture is read off the weights, so one handler serves every export.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file
from tiny_lm_model import alphabet, from_weights


class TinyLMHandler:
    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties["model_dir"]
        self.version = str(context.manifest["model"].get("modelVersion", ""))
        weights = load_file(os.path.join(model_dir, "weights.safetensors"))
        self.block = weights["pos"].shape[1]
        self.model = from_weights(weights)
        self.chars = alphabet()
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.initialized = True

    def next_char(self, text: str) -> str:
        ids = [self.index[c] for c in text if c in self.index][-self.block :]
        if not ids:
            raise ValueError("the input has no character the model knows")
        with torch.no_grad():
            logits = self.model(torch.tensor([ids]))
        return self.chars[int(logits[0, -1].argmax())]

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        out = []
        for row in data:
            body = row.get("data") or row.get("body") or b""
            text = body.decode() if isinstance(body, bytes | bytearray) else str(body)
            out.append(json.dumps({"output": self.next_char(text), "version": self.version}))
        return out
