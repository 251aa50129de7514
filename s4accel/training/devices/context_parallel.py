"""Context parallelism in the loop (`train.context_parallel: P`): the processes' layout, the chunk of each batch a
process trains on, the model told which chunk it reads, and the line a run prints about it.

Layout: processes `d P .. d P + P - 1` share the sequences of data-parallel group `d`, each holding one contiguous
chunk of `seq_len / P` steps (`s4accel/models/context_parallel.py` says why that is exact). Gradients are averaged
over all processes by DDP as usual: a language model's loss is a sum over its chunk's tokens divided by the whole
window's count (`count_items`, gathered over every process), a classifier's loss and the router losses are the same
on every process of a group (their sums are reduced inside the model), so the average is the gradient of whole
sequences. Evaluation reads whole sequences, data-parallel over all processes (no gradient is kept, so one layer's
activations at a time), with the model's split turned off for it (`whole_sequences`).

The mesh is a torch `DeviceMesh` of our own, with Accelerate's dimension names: Accelerate's `ParallelismConfig(
cp_size=...)` would build it too, but it installs torch's ring attention (SDPA only) and refuses context parallelism
beside plain DDP (its data dimension must be FSDP2), and an S4 model needs neither. Accelerate's data loader reads
the `cp` dimension of the state's mesh to hand the processes of one group the same batches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType
from torch.distributed.device_mesh import init_device_mesh

from ...errors import RecipeError
from ...models.context_parallel import ContextParallel
from ...models.modeling_s4 import S4Model, S4PreTrainedModel


@dataclass
class Layout:
    """The run's processes as `(data-parallel groups, P)`: the mesh and this process's context group; both None when
    every process reads whole sequences (`train.context_parallel: 1`), and then every method leaves things as they
    are."""

    mesh: object = None
    parallel: ContextParallel | None = None

    @contextlib.contextmanager
    def dealing(self, accelerator):
        """Within: `accelerator.prepare` of a loader deals its batches per data-parallel group (the processes of a
        context group draw the same ones)."""
        old = accelerator.state.device_mesh
        accelerator.state.device_mesh = self.mesh or old
        try:
            yield
        finally:
            accelerator.state.device_mesh = old

    def attach(self, accelerator, model) -> None:
        """Tell the model its inputs are chunks of this group's sequences."""
        if self.parallel is not None:
            _set(accelerator, model, self.parallel)

    def split(self, batch: dict) -> dict:
        """This process's chunk of each sequence of `batch` (`split_batch`); the batch itself without a split."""
        return batch if self.parallel is None else split_batch(batch, self.parallel)

    def describe(self, accelerator, model, recipe) -> str | None:
        """One line: the split, and what a layer exchanges per micro-batch (the chunks' end states: its size does not
        depend on the length). None without a split."""
        if self.parallel is None:
            return None
        P, L, n = self.parallel.size, recipe.data.seq_len, accelerator.num_processes
        model = accelerator.unwrap_model(model)
        config = model.config
        modes = config.d_state // 2 if config.kernel == "s4d" else config.d_state  # complex state per channel
        floats = recipe.data.batch_size * (config.d_model * modes * 2 * (2 if config.bidirectional else 1) + 1)
        size = P * floats * next(model.parameters()).element_size()
        return (f"context parallel: each sequence of {L:,} steps split over {P} processes (chunks of {L // P:,}), "
                f"{n // P} data-parallel group(s); each S4 layer gathers {size / 1024:,.1f} KB of chunk states per "
                f"micro-batch forward and all-reduces as much backward")


def start(recipe, accelerator) -> Layout:
    """The layout of the run's processes, checked against the launch: refusals are one `RecipeError` before any
    compute. Call on every process (the mesh's groups are made together)."""
    P = recipe.train.context_parallel
    if P == 1:
        return Layout()
    n = accelerator.num_processes
    if n % P:
        raise RecipeError(f"train.context_parallel: {P} must divide the run's {n} process(es) (launch a multiple of "
                          f"{P}, e.g. accelerate launch --num_processes {P})")
    if accelerator.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise RecipeError(f"train.context_parallel runs beside DDP, not {accelerator.distributed_type.value} (launch "
                          f"without an FSDP or DeepSpeed config)")
    mesh = init_device_mesh(accelerator.device.type, (n // P, P), mesh_dim_names=("dp_replicate", "cp"))
    return Layout(mesh, ContextParallel(mesh.get_group("cp")))


def read_whole(accelerator, model) -> None:
    """Whole sequences again (export, samples): any split of the model's S4 layers turned off."""
    for module in accelerator.unwrap_model(model).modules():
        if isinstance(module, S4Model):
            module.context_parallel = None


@contextlib.contextmanager
def whole_sequences(accelerator, model):
    """Within: the model reads whole sequences (evaluation), its split as it was afterwards."""
    split = [m for m in accelerator.unwrap_model(model).modules() if isinstance(m, S4Model)]
    saved = [m.context_parallel for m in split]
    read_whole(accelerator, model)
    try:
        yield
    finally:
        for module, parallel in zip(split, saved):
            module.context_parallel = parallel


def split_batch(batch: dict, parallel: ContextParallel) -> dict:
    """This process's chunk of each sequence in `batch`: every tensor whose second dimension is the sequence's
    (`input_ids` or `input_values`, masks, `position_ids`, token labels), and for token labels `shift_labels`, the
    next-token targets shifted across the whole sequence before it was split (transformers' loss functions take them
    as they are), so the last step of a chunk predicts the first of the next."""
    main = batch["input_ids"] if "input_ids" in batch else batch["input_values"]
    L = main.shape[1]
    if L % parallel.size:
        raise RecipeError(f"train.context_parallel: {parallel.size} must divide the sequences' {L} steps into equal "
                          f"chunks")
    out = {k: parallel.chunk(v) if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == L else v
           for k, v in batch.items()}
    labels = batch.get("labels")
    if labels is not None and labels.dim() == 2 and labels.shape[1] == L:
        out["shift_labels"] = parallel.chunk(torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100))
    return out


def _set(accelerator, model, parallel: ContextParallel | None) -> None:
    found = False
    for module in accelerator.unwrap_model(model).modules():
        if isinstance(module, S4PreTrainedModel):
            module.set_context_parallel(parallel)
            found = True
    if not found:
        raise RecipeError(f"train.context_parallel splits S4 models along the sequence; this run trains "
                          f"{type(accelerator.unwrap_model(model)).__name__}")
