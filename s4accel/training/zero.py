"""DeepSpeed ZeRO under Accelerate: the recipe's step settings handed to DeepSpeed's config before `prepare`.

Under DeepSpeed the update happens inside the engine: Accelerate's `backward` on a window's last micro-batch calls the
engine's `step()`, which clips by the config's `gradient_clipping` and steps the optimizer, and the engine's
`backward` divides the loss by the config's `gradient_accumulation_steps`. So those two numbers must be the recipe's
`train.clip_grad_norm` and `train.grad_accum`: the window of `step.py` holds grad_accum micro-batches and multiplies
the loss by grad_accum x processes to cancel that division and the mean over ranks, as under DDP.
"""

from __future__ import annotations

import contextlib

from accelerate.utils import DistributedType
from transformers.integrations import unset_hf_deepspeed_config

from ..errors import RecipeError


def configure_deepspeed(accelerator, recipe) -> None:
    """Fill DeepSpeed's config from the recipe where it says `auto`; refuse a number the recipe contradicts, and
    what s4accel cannot do under DeepSpeed. Nothing without DeepSpeed."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    cfg, plugin = recipe.train, accelerator.state.deepspeed_plugin
    if cfg.clip_grad_value is not None:
        raise RecipeError("train.clip_grad_value: DeepSpeed clips by norm only (inside its engine); use "
                          "train.clip_grad_norm")
    if cfg.ema is not None and plugin.zero_stage == 3:
        raise RecipeError("train.ema: not available under DeepSpeed ZeRO-3, where no process holds the weights whole "
                          "to average them (ZeRO-2 and FSDP have it)")
    if plugin.zero_stage == 3 and plugin.zero3_init_flag and recipe.model.pretrained is not None:
        raise RecipeError("model.pretrained: not loaded into a model built partitioned (zero3_init_flag: true in the "
                          "DeepSpeed config); set zero3_init_flag: false")
    config = plugin.deepspeed_config
    # 0 is DeepSpeed's "no clipping", the recipe's null
    wanted = {"gradient_accumulation_steps": ("train.grad_accum", cfg.grad_accum),
              "gradient_clipping": ("train.clip_grad_norm", cfg.clip_grad_norm or 0.0)}
    for key, (field, value) in wanted.items():
        given = config.get(key, "auto")
        if given == "auto":
            config[key] = value
        elif float(given) != float(value):
            raise RecipeError(f"{field}={value}, but the DeepSpeed config sets {key}: {given}; set it to auto "
                              f"(s4accel fills in the recipe's value) or to {value}")


def partitioned(model) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the model's parameters over the processes (no process holds them whole)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


@contextlib.contextmanager
def model_build(accelerator):
    """Around building the model: under ZeRO-3 with `zero3_init_flag: false` it is built whole on every process (as
    under DDP: the same initial weights, and `model.pretrained` loads into whole tensors); DeepSpeed partitions it in
    `prepare`. Accelerate 1.15 hands transformers the DeepSpeed config whatever that flag says, and transformers
    then builds every model inside `deepspeed.zero.Init` (partitioned as it is built, initialised in another order)."""
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type == DistributedType.DEEPSPEED else None
    if plugin is None or plugin.zero_stage != 3 or plugin.zero3_init_flag:
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # what Accelerate had set: the config transformers sees from here on

