"""A training checkpoint's model weights, read back whole in one process without a process group, and without
unpickling anything but tensors and the index of a sharded checkpoint:

    model.safetensors           `accelerator.save_state` on one process or under DDP: safetensors
    pytorch_model_fsdp_0/       FSDP's sharded state dict in torch.distributed.checkpoint's format (an index,
                                `.metadata`, and one `__<rank>_0.distcp` file per process), read by torch's own
                                `FileSystemReader` and `dcp.load(no_dist=True)` into full tensors
    custom_checkpoint_<i>.pkl   the EMA callback's state (full tensors: `module.<name>`, `n_averaged`)

torch's reader unpickles the index with a plain `pickle.load`, and its planner unpickles any non-tensor entry with
`torch.load(weights_only=False)`: either could run code from a crafted checkpoint. So the index is read here by an
unpickler that admits only the index's own classes, and only tensor entries are asked for; the tensors themselves torch
reads with `weights_only=True`.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ...errors import ExportError

FULL_WEIGHTS = "model.safetensors"
SHARDED_WEIGHTS = "pytorch_model_fsdp_0"

_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},  # and the dtypes, below
    "torch.serialization": {"_get_layout"},  # how a torch.layout pickles: by its name
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # where the index was written
}
"""Every global a torch.distributed.checkpoint index refers to: dataclasses of plain fields, sizes, dtypes, paths."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in _INDEX_CLASSES.get(module, ()) or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class _SafeReader(FileSystemReader):
    """torch's reader of a DCP folder, with the index read by `_IndexUnpickler`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _IndexUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise ExportError(f"{path}: not a checkpoint index torch wrote, or damaged; refusing to read it "
                              f"({str(e).strip()[:200] or type(e).__name__})") from None
        if not isinstance(metadata, Metadata):
            raise ExportError(f"{path}: not a checkpoint index (a {type(metadata).__name__})")
        metadata.storage_meta = None  # the writer's own record (its temporary folder), not needed to read
        return metadata


def checkpoint_weights_kind(ckpt: Path) -> str:
    """`full` or `sharded`; anything else (DeepSpeed's pickled model states, FSDP's full state dict as a pickle) is
    one line: those are read only by unpickling."""
    if (ckpt / FULL_WEIGHTS).is_file():
        return "full"
    if (ckpt / SHARDED_WEIGHTS / ".metadata").is_file():
        return "sharded"
    found = ", ".join(sorted(p.name for p in ckpt.iterdir() if p.name.startswith(("model", "pytorch_model")))) \
        or "none"
    raise ExportError(f"{ckpt}: its weights are not in a format that can be read without unpickling them (found: "
                      f"{found}; readable: {FULL_WEIGHTS}, or {SHARDED_WEIGHTS}/ as FSDP's sharded state dict "
                      f"writes it)")


def read_model_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's state dict as the checkpoint holds it (full tensors on the CPU), with plain parameter names."""
    if checkpoint_weights_kind(ckpt) == "full":
        weights = load_file(ckpt / FULL_WEIGHTS)
    else:
        weights = _read_sharded(ckpt / SHARDED_WEIGHTS)
    # torch.compile (whole-model or Accelerate's regional) names parameters `..._orig_mod.x`: the plain names.
    return {k.replace("_orig_mod.", ""): v for k, v in weights.items()}


def _read_sharded(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, assembled from all processes' shards. Accelerate saves the model's sharded
    state dict as `{"model": state_dict}`, so each entry is named `model.<parameter>`."""
    reader = _SafeReader(folder)
    metadata = reader.read_metadata()
    entries = metadata.state_dict_metadata
    odd = [k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata) or not k.startswith("model.")]
    if odd:
        raise ExportError(f"{folder}: holds {odd[0]!r}, which is not a tensor of the model's state dict")
    shards = {info.relative_path for info in metadata.storage_data.values()}
    bad = sorted(name for name in shards if Path(name).name != name or not (folder / name).is_file())
    if bad:
        raise ExportError(f"{folder}: its index names shard {bad[0]!r}, which is not a file in the folder")
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)  # fills `state` in place
    except Exception as e:  # torch wraps a reader's error (a truncated shard, a size mismatch) in CheckpointException
        raise ExportError(f"{folder}: cannot be read ({str(e).strip().splitlines()[-1][:200]})") from None
    return {k.removeprefix("model."): v for k, v in state.items()}


def read_ema_weights(ckpt: Path) -> tuple[dict[str, torch.Tensor], int] | None:
    """The EMA callback's averaged parameters (plain names) and how many updates they average, or None when the
    checkpoint holds no EMA state. Registered objects are saved by position, which depends on the run's setup, so the
    EMA's file is the one holding its layout. Read with torch's weights-only unpickler (tensors and plain data)."""
    for f in sorted(ckpt.glob("custom_checkpoint_*.pkl")):
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle.UnpicklingError for anything but tensors and plain data, or a damaged file
            raise ExportError(f"{f}: holds more than tensors and plain data (or is damaged); refusing to unpickle "
                              f"it ({str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__})"
                              ) from None
        if isinstance(state, dict) and "n_averaged" in state and all(
                k == "n_averaged" or (k.startswith("module.") and torch.is_tensor(v)) for k, v in state.items()):
            params = {k.removeprefix("module."): v for k, v in state.items() if k != "n_averaged"}
            return params, int(state["n_averaged"])
    return None
