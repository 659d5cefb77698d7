"""Split a state tree into JSON and named tensors, and join them back.

Non-tensor state (RNG, scheduler, data position, optimizer hyper-parameters) goes
to JSON so that loading never unpickles anything. Types JSON lacks (tuples,
non-string keys, bytes, io.BytesIO, numpy arrays) are tagged so they come back exactly.
A tensor laid out densely in another order than row-major (``channels_last``, a transpose) is saved
row-major with its strides (``__strided__``, where asked), and comes back in its layout, as ``torch.load``
gives it: an optimizer's state then matches its parameter's (a fused optimizer refuses mixed layouts).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rewind.infra.errors import ConfigError

_TAGS = (
    "__tensor__", "__strided__", "__tuple__", "__dict__", "__bytes__", "__bytesio__", "__ndarray__", "__npscalar__"
)  # fmt: skip
_MAX_STRIDE = 1 << 62


def _refuse_dataless(t: torch.Tensor, path: str) -> None:
    """A plain tensor that holds no dense data (meta, sparse, quantized, nested) is a one-line ``ConfigError``
    here, not torch's error from deep in a save. Subclasses (DTensor, ShardedTensor) are DCP's to judge."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return
    why = ""
    if t.device.type == "meta":
        why = "on the meta device (no data yet)"
    elif t.layout is not torch.strided:
        why = f"of layout {t.layout}"
    elif t.is_quantized or t.is_nested:
        why = "quantized" if t.is_quantized else "nested"
    if why:
        raise ConfigError(
            f"the tensor at {path!r} is {why}: Rewind saves and loads dense tensors that hold data "
            "(e.g. .to_dense(), .dequantize(), or its parts as tensors of their own)"
        )


def _numpy(obj: np.ndarray | np.generic, path: str) -> dict[str, Any]:
    """A numpy array or scalar as its dtype and bytes: it comes back of the same dtype (an np.float32 EMA
    stays float32). One whose bytes are not its values (objects, fields, a mask) is a ``ConfigError``."""
    arr = np.asarray(obj, order="C")  # a 0-d array or a scalar stays 0-d (ascontiguousarray makes it 1-d)
    masked = isinstance(obj, np.ma.MaskedArray)  # its mask is not in its bytes (a memmap's values are)
    if masked or arr.dtype.hasobject or arr.dtype.fields is not None:
        raise ConfigError(
            f"cannot checkpoint the numpy {type(obj).__name__} of dtype {arr.dtype} at {path!r}: its bytes are "
            "not its values (objects, named fields or a mask); keep it as a list or as plain arrays"
        )
    data = {
        "dtype": arr.dtype.str,
        "shape": list(arr.shape),
        "data": base64.b64encode(arr.tobytes()).decode(),
    }
    return {"__ndarray__": data} if isinstance(obj, np.ndarray) else {"__npscalar__": data}


def dense_order(shape: list[int] | torch.Size, stride: list[int] | tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely (every element once, no gaps), in whatever order of its
    dimensions; dimensions of size 1 take any stride."""
    if len(stride) != len(shape) or not all(type(s) is int and 0 <= s < _MAX_STRIDE for s in stride):
        return False
    need = 1
    for st, n in sorted((st, n) for st, n in zip(stride, shape, strict=True) if n != 1):
        if st != need:
            return False
        need *= n
    return True


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _strided(t: torch.Tensor) -> bool:
    """A tensor whose layout a restore must give back: dense in another order than row-major, or channels
    last with other strides than row-major's only where a dimension is of size 1 (a 1x1 convolution's:
    torch's ``is_contiguous`` takes it for row-major, a fused optimizer may not). An expanded dimension of
    size 1 alone (a buffer made by ``expand``) is row-major enough."""
    if t.numel() <= 1:
        return False
    if t.is_contiguous():  # the common case, decided without Python's arithmetic (a save's stall runs this)
        last = _CHANNELS_LAST.get(t.dim())
        if last is None or not t.is_contiguous(memory_format=last) or t.stride() == _row_major(t.shape):
            return False
    return dense_order(t.shape, t.stride())


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def gives_layouts(trees: Any) -> bool:
    """Whether JSON trees made by ``split`` give any tensor's layout (``__strided__``)."""
    if isinstance(trees, list):
        return any(gives_layouts(v) for v in trees)
    if not isinstance(trees, dict):
        return False
    return "__strided__" in trees or any(gives_layouts(v) for v in trees.values())


def split(tree: Any, prefix: str, *, strides: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """Return (json_tree, tensors); tensors are named ``prefix/<path>``. ``strides``: a tensor dense in
    another order than row-major is tagged with its strides, to come back in its layout (``join``)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            _refuse_dataless(obj, path)
            if path in tensors:  # {"a.b": t1, "a": {"b": t2}}, {1: t1, "1": t2}: one would load as the other
                raise ConfigError(
                    f"two tensors in the state are both named {path!r}: rename one of their keys"
                )
            tensors[path] = obj
            if strides and _strided(obj):
                return {"__strided__": [path, list(obj.stride())]}
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
        if isinstance(obj, np.ndarray | np.generic):
            return _numpy(obj, path)
        raise ConfigError(
            f"cannot checkpoint {type(obj).__name__} at {path!r}: use tensors, numbers, strings, "
            "lists, tuples, dicts, bytes, io.BytesIO or numpy arrays"
        )

    return walk(tree, prefix), tensors


def _leaf_name(leaf: Any) -> Any:
    """The name of the tensor a JSON leaf stands for (laid out or not); None for any other leaf."""
    if not (isinstance(leaf, dict) and len(leaf) == 1):
        return None
    if "__strided__" in leaf:
        value = leaf["__strided__"]
        return value[0] if isinstance(value, list) and value else None
    return leaf.get("__tensor__")


def tensor_names(tree: Any) -> dict[str, str]:
    """The tensor each key of a flat state names (a module's state dict: string keys, a tensor each), by
    key; empty for any other state. A tensor saved with its layout is named too: a module is loaded into
    its own tensors, whatever the layout it was saved in (``in_place`` takes only contiguous ones)."""
    if not isinstance(tree, dict):
        return {}
    names: dict[str, str] = {}
    for key, leaf in tree.items():
        name = _leaf_name(leaf)
        if not isinstance(name, str):
            return {}
        names[key] = name
    return names


def join(tree: Any, tensors: Mapping[str, torch.Tensor], *, layouts: bool = True) -> Any:
    """Inverse of :func:`split`. ``layouts``: a ``__strided__`` tensor is given back in its saved layout (a
    copy); False: as read, row-major (for a state object that copies what it is given into its own)."""
    if isinstance(tree, list):
        return [join(v, tensors, layouts=layouts) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, value),) = tree.items()
        if tag == "__tensor__":
            if value not in tensors:
                raise KeyError(f"tensor {value!r} is named in the state but missing from the data file")
            return tensors[value]
        if tag == "__strided__":
            return _laid_out(value, tensors, layouts)
        if tag == "__tuple__":
            return tuple(join(v, tensors, layouts=layouts) for v in value)
        if tag == "__dict__":
            return {join(k, tensors, layouts=layouts): join(v, tensors, layouts=layouts) for k, v in value}
        if tag == "__bytes__":
            return base64.b64decode(value)
        if tag == "__bytesio__":
            out = io.BytesIO(base64.b64decode(value[0]))
            out.seek(int(value[1]))
            return out
        if tag in ("__ndarray__", "__npscalar__"):
            raw = base64.b64decode(value["data"])
            arr = np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
            return arr if tag == "__ndarray__" else arr[()]
    return {k: join(v, tensors, layouts=layouts) for k, v in tree.items()}


def _laid_out(value: Any, tensors: Mapping[str, torch.Tensor], layouts: bool) -> torch.Tensor:
    """A ``__strided__`` tensor (``[name, strides]``, read row-major) copied into its saved layout (as read
    where not ``layouts``)."""
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], list)):
        raise ValueError(f"malformed strided tensor {str(value)[:100]}")
    name, stride = value
    if name not in tensors:
        raise KeyError(f"tensor {name!r} is named in the state but missing from the data file")
    t = tensors[name]
    if not dense_order(t.shape, stride):
        raise ValueError(f"tensor {name!r}: strides {stride[:8]} do not lay out its shape {list(t.shape)}")
    if not layouts:
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
