"""Loading torch.distributed.checkpoint (DCP) checkpoints through Rewind's verification.

DCP's own ``FileSystemReader`` opens shard files itself and unpickles
``.metadata`` with plain ``pickle.load``: a damaged or forged file would be
used, or executed, before anyone checked it. ``VerifiedReader`` keeps DCP's
planning and resharding but routes every file through a read-only file system
that reads the whole file once, hashes those bytes and hands DCP only the bytes
that matched the manifest, so there is no window between check and use.
``.metadata`` is further decoded with an unpickler that can build nothing but
DCP's own metadata types, and non-tensor values (which DCP unpickles with
``weights_only=False``) must first decode with ``weights_only=True``, so even
files whose digests were forged together with the catalog cannot run code.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import sys
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from rewind.infra.errors import CorruptCheckpoint, Refused, StateMismatch
from rewind.infra.format.manifest import FileEntry
from rewind.infra.format.nearest import Nearest
from rewind.infra.format.verify import Finding, Problem

METADATA_NAME = ".metadata"
_DCP_MODULE = "torch.distributed.checkpoint"
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)

# Everything a real .metadata names besides DCP's dataclasses, enums and torch dtypes
# (see tests/test_dcp_reader.py): torch.Size for shapes and offsets, torch's layout
# decoder, and the pathlib class StorageMeta.checkpoint_id holds. ``pathlib._local``
# is where Python 3.13+ pickles path classes from.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): Path if os.name == "posix" else PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib._local", "PosixPath"): Path if os.name == "posix" else PurePosixPath,
    ("pathlib._local", "PurePosixPath"): PurePosixPath,
}


def _content(location: str, path: str, detail: str) -> StateMismatch:
    """Bytes that matched their digest and still cannot be loaded by this process.

    Not a damaged copy (every copy holds the same bytes) and not proven bad either:
    a newer torch may write metadata this allow-list does not know. The restore path
    condemns the checkpoint only if an older one then loads.
    """
    return StateMismatch(location, [Finding(Problem.CONTENT, path, detail)])


def _torch_constant(module: str, name: str) -> Any:
    """A dtype, layout or memory format; memory formats pickle as ``torch._utils``/``torch.<name>``."""
    if module == "torch._utils" and name.startswith("torch."):
        name = name.removeprefix("torch.")
    elif module != "torch":
        return None
    obj = getattr(torch, name, None) if "." not in name else None
    return obj if isinstance(obj, _TORCH_CONSTANTS) else None


def _dcp_type(module: str, name: str) -> type | None:
    """A dataclass or enum defined in an already imported DCP module (nothing is imported here)."""
    if module != _DCP_MODULE and not module.startswith(_DCP_MODULE + "."):
        return None
    obj = getattr(sys.modules.get(module), name, None) if "." not in name else None
    if not isinstance(obj, type) or obj.__module__ != module:
        return None
    return obj if dataclasses.is_dataclass(obj) or issubclass(obj, Enum) else None


def allowed_global(module: str, name: str) -> Any:
    """The object a metadata pickle may name as ``module.name``, or None when it is refused."""
    if (module, name) in _ALLOWED:
        return _ALLOWED[module, name]
    found = _torch_constant(module, name)
    return found if found is not None else _dcp_type(module, name)


def _buildable(inst: Any, state: Any) -> bool:
    """May pickle's BUILD set ``state`` on ``inst``? Only on an instance (never a class, whose methods it
    would replace for the whole process) of a DCP dataclass: through the class's own ``__setstate__``, or
    a state naming only its fields."""
    cls = type(inst)
    if isinstance(inst, type) or _dcp_type(cls.__module__, cls.__qualname__) is not cls:
        return False
    if getattr(cls, "__setstate__", None) is not None and "__setstate__" in vars(cls):
        return True
    fields = {f.name for f in dataclasses.fields(inst)} if dataclasses.is_dataclass(inst) else set()
    in_dict, in_slots = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
    # the instance's __dict__ may take fields a newer torch added (Metadata.version); never a dunder
    extra_ok = isinstance(in_dict, dict) and all(
        isinstance(k, str) and not k.startswith("__") for k in in_dict
    )
    slots_ok = in_slots is None or (isinstance(in_slots, dict) and set(in_slots) <= fields)  # set by setattr
    return (in_dict is None or extra_ok) and slots_ok


# Python's own unpickler, whose BUILD can be checked (the C one's cannot)
_PyUnpickler: Any = pickle._Unpickler


class _MetadataUnpickler(_PyUnpickler):
    """An unpickler that resolves only the globals DCP metadata consists of, and builds only their
    instances (the C unpickler would let BUILD set attributes on any object, a class included)."""

    dispatch: dict[int, Callable[[Any], None]] = dict(_PyUnpickler.dispatch)

    def __init__(self, data: bytes | bytearray | memoryview, location: str, name: str) -> None:
        super().__init__(io.BytesIO(data))
        self._location = location
        self._name = name

    def _load_build(self) -> None:
        if len(self.stack) < 2 or not _buildable(self.stack[-2], self.stack[-1]):
            raise _content(self._location, self._name, "refuses to build anything but DCP's own records")
        _PyUnpickler.dispatch[pickle.BUILD[0]](self)

    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        found = allowed_global(module, name)
        if found is None:
            raise _content(self._location, self._name, f"refuses to unpickle {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _content(self._location, self._name, "refuses a persistent id")


def load_metadata(
    raw: bytes | bytearray | memoryview, *, location: str = "<memory>", name: str = METADATA_NAME
) -> Metadata:
    """Decode DCP ``.metadata`` bytes without letting them name any other code.

    Callers must already have checked ``raw`` against its digest; this guards
    against a digest forged together with the file.
    """
    try:
        metadata = _MetadataUnpickler(raw, location, name).load()
    except CorruptCheckpoint:
        raise
    except Exception as exc:  # any decoding failure of verified bytes means a bad file
        raise _content(location, name, f"not DCP metadata: {exc!r}") from exc
    if not isinstance(metadata, Metadata):
        raise _content(location, name, f"holds a {type(metadata).__name__}, not Metadata")
    return metadata


class VerifiedFileSystem(FileSystemBase):
    """DCP's file system, read-only, yielding only whole files whose digest matched.

    The whole file is read into memory because DCP seeks around in it: hashing
    while streaming could not stop DCP from using bytes before the digest is known.
    """

    def __init__(
        self, directory: Path, entries: Mapping[str, FileEntry], reads: Nearest | None = None
    ) -> None:
        self.directory = Path(directory)
        self.entries = entries
        self.reads = reads if reads is not None else Nearest(self.directory)  # a nearer copy's files first

    def _relative(self, path: str | os.PathLike) -> str:
        try:
            rel = Path(path).relative_to(self.directory)
        except ValueError:
            rel = None
        if rel is None or ".." in rel.parts:
            raise _content(
                str(self.directory), str(path), "DCP names a file outside the checkpoint directory"
            )
        return rel.as_posix()

    def read_verified(self, path: str | os.PathLike) -> io.BytesIO:
        """The file's bytes, read once and proven to match its entry (the one verified read)."""
        rel = self._relative(path)
        entry = self.entries.get(rel)
        if entry is None:
            raise _content(str(self.directory), rel, "DCP needs a file the manifest does not list")
        return io.BytesIO(self.reads.read(entry))

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise Refused(f"a verified checkpoint is read-only; refused mode {mode!r}")
        with self.read_verified(path) as stream:
            yield stream

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return Path(path) / suffix

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return Path(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise Refused("a verified checkpoint is read-only; refused rename")

    def mkdir(self, path: str | os.PathLike) -> None:
        raise Refused("a verified checkpoint is read-only; refused mkdir")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)

    def exists(self, path: str | os.PathLike) -> bool:
        return self.entries.get(self._relative(path)) is not None

    def rm_file(self, path: str | os.PathLike) -> None:
        raise Refused("a verified checkpoint is read-only; refused rm_file")


def _first_reason(exc: BaseException) -> str:
    """The line of torch's weights-only refusal that names the global, else its first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [repr(exc)]
    return next((ln for ln in lines if "GLOBAL" in ln), lines[0])


# Globals a non-tensor value may name beyond torch's own weights-only set: TorchTitan's TrainState keeps
# its loss history as io.BytesIO (whose state is its own buffer and position, nothing it could run).
_VALUE_GLOBALS = (io.BytesIO,)


@contextmanager
def _values_allowed() -> Generator[None, None, None]:
    """``torch.load(weights_only=True)`` admitting ``_VALUE_GLOBALS`` too, for this call only where torch can."""
    scoped = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    if scoped is None:
        torch.serialization.add_safe_globals(list(_VALUE_GLOBALS))
        yield
        return
    with scoped(list(_VALUE_GLOBALS)):
        yield


class _SafeValues:
    """Passes the planner only non-tensor values that decode with ``torch.load(weights_only=True)``.

    DCP's planners unpickle those values with ``weights_only=False``: a shard forged
    together with its digest could otherwise run code, as ``.metadata`` could.
    """

    def __init__(self, planner: LoadPlanner, reader: VerifiedReader) -> None:
        self._planner = planner
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            with _values_allowed():
                torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:  # any decoding failure of verified bytes means a bad file
            fqn = read_item.storage_index.fqn
            info = self._reader.storage_data.get(read_item.storage_index)
            raise _content(
                str(self._reader.verified.directory),
                getattr(info, "relative_path", fqn),
                f"value {fqn} refused by torch.load(weights_only=True): {_first_reason(exc)}",
            ) from exc
        value.seek(0)
        self._planner.load_bytes(read_item, value)


class VerifiedReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` that uses no byte before it matched ``entries``.

    ``entries`` maps each file's path relative to ``directory`` to its manifest
    entry. ``.metadata`` and non-tensor values are decoded by restricted
    unpicklers (tensors already are, by DCP). Refusals raise ``CorruptCheckpoint``;
    OS errors other than a missing file propagate unchanged (transient). DCP
    wraps whatever a reader raises, so the first refusal is also kept in
    ``refusal`` for :func:`load`.
    """

    def __init__(
        self, directory: Path, entries: Mapping[str, FileEntry], reads: Nearest | None = None
    ) -> None:
        super().__init__(Path(directory))
        self.verified = VerifiedFileSystem(Path(directory), entries, reads)
        self.fs = self.verified  # type: ignore[assignment]  # DCP calls only FileSystemBase methods on it
        self.refusal: BaseException | None = None

    def _note(self, exc: BaseException) -> None:
        if self.refusal is None:
            self.refusal = exc

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            raw = self.verified.read_verified(path).getvalue()
            metadata = load_metadata(raw, location=str(self.verified.directory), name=Path(path).name)
        except (CorruptCheckpoint, OSError) as exc:
            self._note(exc)
            raise
        meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, _SafeValues(planner, self))  # type: ignore[arg-type]
        except (CorruptCheckpoint, OSError) as exc:
            self._note(exc)
            raise


def load(
    state_dict: dict[str, Any],
    directory: Path,
    entries: Mapping[str, FileEntry],
    *,
    process_group: Any = None,
    reads: Nearest | None = None,
) -> None:
    """``dcp.load`` through a ``VerifiedReader``, re-raising this rank's own refusal unwrapped.

    DCP turns a reader's exception into ``CheckpointException`` carrying only
    its text; the caller needs the ``CorruptCheckpoint`` or ``OSError`` itself
    to classify it. ``reads``: where files are read from (a nearer copy's first), counted.
    """
    reader = VerifiedReader(directory, entries, reads)
    try:
        dcp.load(state_dict, storage_reader=reader, process_group=process_group)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        if reader.refusal is not None and reader.refusal is not exc:
            raise reader.refusal from exc
        raise
