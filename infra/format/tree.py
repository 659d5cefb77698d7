"""Split a state tree into JSON and named tensors, and join them back.

Non-tensor state (RNG, scheduler, data position, optimizer hyper-parameters) goes
to JSON so that loading never unpickles anything. Types JSON lacks (tuples,
non-string keys, bytes, io.BytesIO, numpy arrays) are tagged so they come back exactly.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rewind.infra.errors import ConfigError

_TAGS = ("__tensor__", "__tuple__", "__dict__", "__bytes__", "__bytesio__", "__ndarray__")


def _refuse_dataless(t: torch.Tensor, path: str) -> None:
    """A plain tensor that holds no dense data (meta, sparse, quantized, nested) is a one-line ``ConfigError``
    here, not torch's error from deep in a save. Subclasses (DTensor, ShardedTensor) are DCP's to judge."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return
    why = (
        "on the meta device (no data yet)"
        if t.device.type == "meta"
        else f"of layout {t.layout}"
        if t.layout is not torch.strided
        else "quantized"
        if t.is_quantized
        else "nested"
        if t.is_nested
        else ""
    )
    if why:
        raise ConfigError(
            f"the tensor at {path!r} is {why}: Rewind saves and loads dense tensors that hold data "
            "(e.g. .to_dense(), .dequantize(), or its parts as tensors of their own)"
        )


def split(tree: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Return (json_tree, tensors); tensors are named ``prefix/<path>``."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            _refuse_dataless(obj, path)
            tensors[path] = obj
            return {"__tensor__": path}
        if obj is None or isinstance(obj, bool | int | float | str):
            return obj
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) and k not in _TAGS for k in obj):
                return {k: walk(v, f"{path}.{k}") for k, v in obj.items()}
            return {"__dict__": [[walk(k, f"{path}.<key>"), walk(v, f"{path}.{k}")] for k, v in obj.items()]}
        if isinstance(obj, tuple):
            return {"__tuple__": [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, bytes | bytearray):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
        if type(obj) is io.BytesIO:  # TorchTitan's TrainState keeps its loss history so
            return {"__bytesio__": [base64.b64encode(obj.getvalue()).decode(), obj.tell()]}
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return {
                "__ndarray__": {
                    "dtype": arr.dtype.str,
                    "shape": list(arr.shape),
                    "data": base64.b64encode(arr.tobytes()).decode(),
                }
            }
        if isinstance(obj, np.generic):
            return walk(obj.item(), path)
        raise ConfigError(
            f"cannot checkpoint {type(obj).__name__} at {path!r}: use tensors, numbers, strings, "
            "lists, tuples, dicts, bytes, io.BytesIO or numpy arrays"
        )

    return walk(tree, prefix), tensors


def join(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split`."""
    if isinstance(tree, list):
        return [join(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, value),) = tree.items()
        if tag == "__tensor__":
            if value not in tensors:
                raise KeyError(f"tensor {value!r} is named in the state but missing from the data file")
            return tensors[value]
        if tag == "__tuple__":
            return tuple(join(v, tensors) for v in value)
        if tag == "__dict__":
            return {join(k, tensors): join(v, tensors) for k, v in value}
        if tag == "__bytes__":
            return base64.b64decode(value)
        if tag == "__bytesio__":
            out = io.BytesIO(base64.b64decode(value[0]))
            out.seek(int(value[1]))
            return out
        if tag == "__ndarray__":
            raw = base64.b64decode(value["data"])
            return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    return {k: join(v, tensors) for k, v in tree.items()}
