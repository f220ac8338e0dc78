"""Reading DCP checkpoints from shared storage without running what a stranger planted there.

A DCP directory's `.metadata` is a pickle, and DCP's own reader unpickles it as it is, and
loads every non-tensor item with `torch.load(weights_only=False)`: a crafted file in any run
directory under a shared output root would run code in whoever verifies, reads back, exports,
reports or resumes from it. Here `.metadata` goes through an unpickler that resolves only the
classes DCP writes into it (its metadata dataclasses, `torch.Size`, dtypes, layouts, paths),
its storage entries must name plain files inside the checkpoint directory, and non-tensor items
load with `weights_only=True` (numbers, strings, lists, dicts, tuples, tensors: what the actor's
optimiser and schedule states hold). Everything the library reads of a checkpoint goes through
`read_metadata`, `SafeFileSystemReader` and `SafeLoadPlanner`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from rlinf_twoworker.errors import CheckpointReadError

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Checkpoints written by older PyTorch (RLinf's images) keep these here.
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties", "MEM_FORMAT_ENCODING"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "PurePath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnsafeCheckpointError(CheckpointReadError):
    """A checkpoint file holds something other than what DCP writes: it is not loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: io.BytesIO, path: Path) -> None:
        super().__init__(data)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path} asks to load {module}.{name}, which DCP never writes into a "
            "checkpoint's metadata: the file was not written by PyTorch's checkpointing and is "
            "not loaded (nothing in it ran); remove it, or ask who can write to this storage "
            "why it is there"
        )


def unpickle_metadata(path: Path) -> Metadata:
    """The Metadata in the file at `path`, read by the allow-list unpickler and checked: every
    storage entry names a plain file of the checkpoint directory. UnsafeCheckpointError for a
    file that is not DCP's; pickle's own errors for a damaged one."""
    data = io.BytesIO(Path(path).read_bytes())
    metadata = _MetadataUnpickler(data, Path(path)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{path} holds a {type(metadata).__name__}, not DCP's Metadata: not a checkpoint"
        )
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or Path(name).name != name or name in ("..", "."):
            raise UnsafeCheckpointError(
                f"{path} names the shard {name!r}, which is not a file of its own directory: "
                "a checkpoint never reads outside it; the file is not loaded"
            )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` through `unpickle_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = unpickle_metadata(Path(self.path) / ".metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor items with weights_only=True (DCP's own
    `load_bytes` unpickles them with weights_only=False)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"checkpoint item {fqn} holds an object that is not plain data "
                f"({str(exc).splitlines()[0][:160]}); it is not loaded"
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item


def refusal_in(exc: BaseException) -> UnsafeCheckpointError | None:
    """The UnsafeCheckpointError behind a failed DCP load (DCP wraps each rank's error in a
    CheckpointException, whose message is every rank's traceback), or None."""
    if isinstance(exc, UnsafeCheckpointError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        if isinstance(failure, tuple) and isinstance(failure[0], UnsafeCheckpointError):
            return failure[0]
    return None
