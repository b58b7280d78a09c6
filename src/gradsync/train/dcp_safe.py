"""Reading a sharded checkpoint (torch.distributed.checkpoint) without running anyone's code.

DCP keeps a checkpoint's index, ``.metadata``, as a pickle, and every value of the state that is
not a tensor (the optimizer's param_groups: lr, betas, eps, ...) as a ``torch.save`` pickle of
its own inside the ``.distcp`` files, which torch's default planner loads with
``weights_only=False``. Both would run code planted by whoever can write the run's checkpoint
dir (and rewrite the sidecar's digests) as the user who resumes. gradsync reads them restricted:

- ``.metadata`` through an unpickler that builds DCP's own metadata records and the torch
  values they hold (sizes, dtypes, layouts, paths) and nothing else: any other global a pickle
  names (``os.system``, ``builtins.exec``, a class with a ``__reduce__`` of its own) is refused
  with the name it asked for, before anything is built;
- every non-tensor value with ``torch.load(weights_only=True)`` (numbers, strings, tuples,
  lists, dicts, None), as the tensors already are;
- every piece the index points at must lie inside one of the checkpoint's own shard files
  (``__<rank>_<n>.distcp``), with no storage transform (gradsync writes none).

The job checks all of it before any rank starts (train/checkpoint.py ``verify``); the ranks
read through the same restrictions (``reader``, ``planner``), so a file swapped in between is
refused too.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch

METADATA = ".metadata"
SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(ValueError):
    """A sharded checkpoint that holds something else than DCP's records, tensors and plain
    values; its message names the file and what it asked for."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: BinaryIO, where: Path):
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"{self.where}: refused: it names {module}.{name}, which is not "
                               "part of a checkpoint's index (nothing of it was run)")


def read_metadata(ckpt: Path, rank: int | None = None) -> Any:
    """The index (DCP's Metadata) of the sharded checkpoint directory `ckpt`, read restricted
    and checked."""
    from torch.distributed.checkpoint.metadata import Metadata  # seconds: only when resuming

    path = ckpt / (METADATA if rank is None else f"__{rank}{METADATA}")
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpoint:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError,
            ValueError) as e:
        raise UnsafeCheckpoint(f"{path}: unreadable checkpoint index "
                               f"({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        raise UnsafeCheckpoint(f"{path}: refused: not a checkpoint index (it holds "
                               f"{type(meta).__name__})")
    for info in meta.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not SHARD_FILE.fullmatch(name):
            raise UnsafeCheckpoint(f"{path}: refused: it points at {name!r}, not a shard file "
                                   "of the checkpoint")
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpoint(f"{path}: refused: storage transforms "
                                   f"{info.transform_descriptors} (gradsync writes none)")
    return meta


def load_value(data: BinaryIO, fqn: str, where: Path | str) -> Any:
    """The value of `fqn` (a non-tensor of the state, read from the file `where`): plain data
    only, UnsafeCheckpoint otherwise."""
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"(?:unsupported|Unsupported global:) GLOBAL (\S+)", str(e))
        what = f"it names {named.group(1)}" if named else "it is not plain data"
        raise UnsafeCheckpoint(f"{where}: refused: the value of {fqn}: {what} (nothing of it "
                               "was run)") from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise UnsafeCheckpoint(f"{where}: corrupt checkpoint: the value of {fqn} is unreadable "
                               f"({type(e).__name__})") from None


def check(ckpt: Path) -> None:
    """Everything a resume will read from `ckpt` that could run code: its index and each of
    its non-tensor values (UnsafeCheckpoint otherwise)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = read_metadata(ckpt)
    sizes = {f.name: f.stat().st_size for f in ckpt.iterdir() if SHARD_FILE.fullmatch(f.name)}
    for index, info in meta.storage_data.items():
        if info.relative_path not in sizes or info.offset < 0 or info.length < 0 or \
                info.offset + info.length > sizes[info.relative_path]:
            raise UnsafeCheckpoint(f"{ckpt / METADATA}: corrupt checkpoint: {index.fqn} lies "
                                   f"outside {info.relative_path}")
        if not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            piece = io.BytesIO(f.read(info.length))
        load_value(piece, index.fqn, ckpt / info.relative_path)


def reader(ckpt: Path) -> Any:
    """torch's FileSystemReader for `ckpt` with the index read restricted (read_metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta = read_metadata(Path(self.path), kwargs.get("rank"))
            if getattr(meta, "storage_meta", None) is None:  # as torch's read_metadata does
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return Reader(ckpt)


def planner() -> Any:
    """torch's DefaultLoadPlanner with non-tensor values loaded as plain data (load_value)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            assert self.metadata is not None  # set_up_planner ran
            obj = load_value(value, fqn, self.metadata.storage_data[
                read_item.storage_index].relative_path)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return Planner()
