"""Whether a built-in model can be trained in this machine's memory, told from its config before anything is
allocated: a recipe asking for 100,000 layers, or a LoRA rank of ten million, ran for minutes and took all the
memory before an allocator traceback.

The estimate counts the parameters, and for each trainable one its gradient and the optimizer's state (float32: 16
bytes a trainable parameter with AdamW's two moments, 8 with plain SGD's none, 4 a fixed one), from a model with one
and with two blocks on the meta device (shapes only, no memory) extended to every block, so a recipe of any depth is
estimated in a moment; and a low figure for the activations a micro-batch keeps for the backward pass:
`ACTIVATION_FLOATS` float32 values per block, token and channel (the quick-start's S4 blocks keep about 21:
`bench/context_memory.py`), two with activation checkpointing.
The estimate errs low: a model it lets through may still not fit (`s4accel find-batch-size` measures a step).

Under FSDP and DeepSpeed ZeRO each process holds its share of what is sharded (`Shards`): ZeRO-1 the optimizer state,
ZeRO-2 the gradients too, ZeRO-3 and FSDP the weights too; but never less than the whole weights, which every process
builds before they are sharded (but for ZeRO-3's `zero3_init_flag: true`, which builds them partitioned).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from accelerate.utils import DistributedType

from ...errors import RecipeError
from ..optim import state_floats


class Shards(NamedTuple):
    """Over how many processes the weights, the gradients and the optimizer's state are split, and whether every
    process builds the whole weights first."""
    weights: int = 1
    gradients: int = 1
    moments: int = 1
    built_whole: bool = True
    how: str = ""  # for the error line, e.g. "FSDP over 8 processes"; "" where nothing is sharded

    def state_bytes(self, trainable: int, fixed: int, floats: int = 2) -> float:
        """One process's weights, gradients and optimizer state (float32; `floats` values of state per trained
        weight: AdamW's two moments by default)."""
        held = (trainable * (4 / self.weights + 4 / self.gradients + 4 * floats / self.moments)
                + fixed * 4 / self.weights)
        return max(held, 4 * (trainable + fixed)) if self.built_whole else held


def shards(accelerator) -> Shards:
    """How the run's distribution splits a step's states over its processes."""
    n = accelerator.num_processes
    if n == 1:
        return Shards()
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        if plugin.fsdp_version == 1 and getattr(plugin.sharding_strategy, "name", None) == "NO_SHARD":
            return Shards()
        return Shards(n, n, n, how=f"FSDP over {n} processes")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        plugin = accelerator.state.deepspeed_plugin
        stage = plugin.zero_stage
        return Shards(n if stage >= 3 else 1, n if stage >= 2 else 1, n if stage >= 1 else 1,
                      built_whole=not (stage == 3 and plugin.zero3_init_flag),
                      how=f"DeepSpeed ZeRO-{stage} over {n} processes")
    return Shards()


ACTIVATION_FLOATS = 16


def available_bytes(device: torch.device) -> int | None:
    """Memory a run may use: the device's on a GPU, what Linux says is available on a CPU; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def counted(model) -> tuple[int, int]:
    """(trainable, fixed) parameter counts, each tied tensor once."""
    trainable = fixed = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            fixed += p.numel()
    return trainable, fixed


def check_fits(recipe, spec: dict, device: torch.device, build, split: Shards = Shards()) -> None:
    """Refuse, in one line, a built-in model whose parameters and optimizer state alone exceed this machine's memory.
    `build(recipe, spec)` builds the recipe's model on the meta device; `split`: how the run shards its states."""
    limit = available_bytes(device)
    if limit is None:
        return
    layers = recipe.model.overrides.get("n_layer")
    sizes = []
    for n in ((1, 2) if isinstance(layers, int) and layers > 2 else (None,)):
        shallow = recipe if n is None else recipe.model_copy(update={"model": recipe.model.model_copy(
            update={"overrides": {**recipe.model.overrides, "n_layer": n}})})
        sizes.append(counted(build(shallow, spec)))
    if len(sizes) == 2:  # one block's worth, extended to every block
        (t1, f1), (t2, f2) = sizes
        trainable, fixed = t1 + (layers - 1) * (t2 - t1), f1 + (layers - 1) * (f2 - f1)
    else:
        trainable, fixed = sizes[0]
    states = split.state_bytes(trainable, fixed, state_floats(recipe.optim))
    model = build(recipe if len(sizes) == 1 else shallow, spec)
    config = getattr(model, "get_base_model", lambda: model)().config  # a LoRA model's: its base's
    floats = 2 if recipe.train.activation_checkpointing else ACTIVATION_FLOATS
    blocks = layers if isinstance(layers, int) else getattr(config, "n_layer", 1)
    activations = blocks * recipe.data.batch_size * recipe.data.seq_len * getattr(config, "d_model", 0) * floats * 4
    # A step reads its whole accumulation window first (the loss is normalised by the window's target tokens):
    # grad_accum micro-batches of ids, labels and positions, int64, held at once.
    window = recipe.train.grad_accum * recipe.data.batch_size * recipe.data.seq_len * 3 * 8
    if window > limit:
        raise RecipeError(f"train.grad_accum={recipe.train.grad_accum}: a step holds its whole window of "
                          f"micro-batches, about {window / 1e9:,.1f} GB at data.batch_size={recipe.data.batch_size} "
                          f"and data.seq_len={recipe.data.seq_len}, more than the {limit / 1e9:,.1f} GB this machine "
                          f"has available; use fewer, larger micro-batches")
    if states + activations > limit:
        what = f"model.overrides.n_layer={layers}" if len(sizes) == 2 else \
            f"model.lora.r={recipe.model.lora.r}" if recipe.model.lora is not None else "model.overrides"
        raise RecipeError(f"{what}: the model would hold {trainable + fixed:,} parameters ({trainable:,} trained): "
                          f"about {states / 1e9:,.1f} GB with their gradients and optimizer state"
                          f"{f' (each process its share under {split.how})' if split.how else ''}, and "
                          f"{activations / 1e9:,.1f} GB or more of activations for a micro-batch, more than the "
                          f"{limit / 1e9:,.1f} GB this machine has available; choose a smaller model")
