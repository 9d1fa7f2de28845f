"""Read DCP checkpoints without unpickling arbitrary objects.

`torch.distributed.checkpoint`'s `FileSystemReader` reads a checkpoint's `.metadata` with
`pickle.load`, and its default load planner reads every non-tensor value (optimizer
hyperparameters) with `torch.load(weights_only=False)`: a tampered checkpoint whose manifest was
recomputed to match would run code of its author's choosing on load. Here the metadata goes
through an unpickler that constructs only DCP's own metadata dataclasses, `torch.Size`, dtypes,
layouts and memory formats (and refuses anything else in one sentence), and non-tensor values are
read with `torch.load(weights_only=True)`. Tensors are read as DCP reads them (`weights_only=True`).
"""
from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import TesseraError

# module -> names the metadata of a DCP checkpoint may name (see `_allowed`)
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


def _allowed(module: str, name: str) -> bool:
    if name in _ALLOWED.get(module, ()):
        return True
    if module == "torch":  # dtypes, layouts and memory formats are named as torch.<name>
        value = getattr(torch, name, None)
        return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return super().find_class(module, name)


def read_metadata(path: str | Path):
    """The `Metadata` of the DCP checkpoint in `path`, unpickled with the allowlist above."""
    path = Path(path)
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise TesseraError(f"checkpoint {path} is corrupt: .metadata is missing") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
        raise TesseraError(f"checkpoint {path} is refused: its .metadata holds something other than "
                           f"checkpoint metadata ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if type(metadata).__name__ != "Metadata":
        raise TesseraError(f"checkpoint {path} is refused: its .metadata is not checkpoint metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by `read_metadata` above."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        if rank is not None:  # a per-rank metadata file (not what Tessera writes): DCP's own path
            raise TesseraError(f"checkpoint {self.path} has per-rank metadata, which Tessera does not read")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with `weights_only=True`."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DCP's planner uses

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
