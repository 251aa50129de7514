"""DeepSpeed ZeRO under Accelerate: the recipe's step settings and precision handed to DeepSpeed's config before
`prepare`.

Under DeepSpeed the update happens inside the engine: Accelerate's `backward` on a window's last micro-batch calls the
engine's `step()`, which clips by the config's `gradient_clipping` and steps the optimizer, and the engine's
`backward` divides the loss by the config's `gradient_accumulation_steps`. So those two numbers must be the recipe's
`train.clip_grad_norm` and `train.grad_accum`: the window of `step.py` holds grad_accum micro-batches and multiplies
the loss by grad_accum x processes to cancel that division and the mean over ranks, as under DDP.

bf16: DeepSpeed's `bf16` mode (what Accelerate writes for `mixed_precision: bf16`) casts every floating parameter of
the model to bf16 and keeps fp32 copies only in the optimizer; its `keep_in_fp32_modules` keeps buffers, not
parameters. S4's SSM parameters would then be read in bf16, which steps by 0.5 near 97, where Im(A) reaches at
d_state 64. DeepSpeed's `torch_autocast` mode is the policy the S4 layers need: parameters stay fp32 (so do the
weights ZeRO-3 gathers for the export), the forward runs under torch.autocast (the S4 kernel turns it off for its own
math), and gradients are reduced in bf16 only for the modules listed as lower-precision safe (DeepSpeed's default:
Linear and Conv layers; ZeRO-3 also all-gathers their weights in bf16); every other parameter, the SSM's among them,
is reduced and gathered in fp32.
"""

from __future__ import annotations

import contextlib
import sys

from accelerate.utils import DistributedType
from transformers.integrations import unset_hf_deepspeed_config

from ...errors import RecipeError


def deepspeed_imported_only_where_used() -> None:
    """Accelerate 1.15's `unwrap_model` imports DeepSpeed wherever it is installed, to see whether the model is a
    DeepSpeed engine: about 3 s of every command on our CPUs, and DeepSpeed's "Setting accelerator to ..." line on
    the console of a run that does not use it. A model is an engine only once DeepSpeed is imported (Accelerate's
    `prepare` imports it for a DeepSpeed run), so the check looks there first. Once per process."""
    from accelerate.utils import other

    available = other.is_deepspeed_available
    if getattr(available, "imported_first", False):
        return

    def imported_and_available() -> bool:
        return "deepspeed" in sys.modules and available()

    imported_and_available.imported_first = True
    other.is_deepspeed_available = imported_and_available


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
    for section, key in (("optimizer", "optim.name"), ("scheduler", "scheduler.name")):
        if section in config:  # Accelerate would refuse it with a traceback after the data and model are built
            kind = config[section].get("type", "?") if isinstance(config[section], dict) else "?"
            raise RecipeError(f"{key}: the DeepSpeed config has its own {section} ({kind}); s4accel builds the "
                              f"recipe's ({key}): remove the config's {section!r} section")
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
    if config.get("bf16", {}).get("enabled") is True:
        # bf16 compute, fp32 parameters and SSM gradient reductions (see above); what Accelerate's precision flag or
        # train.mixed_precision turned on, or a config's own bf16 section
        config["bf16"]["enabled"] = False
        config.setdefault("torch_autocast", {}).update(enabled=True, dtype="bfloat16")


def partitioned(model) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the model's parameters over the processes (no process holds them whole)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def precision(accelerator) -> str:
    """The mixed precision a run computes in, for its log: Accelerate reports "no" for DeepSpeed's torch_autocast."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        autocast = accelerator.state.deepspeed_plugin.deepspeed_config.get("torch_autocast", {})
        if autocast.get("enabled"):
            return f"{autocast.get('dtype', 'bfloat16')} autocast, parameters float32 (DeepSpeed torch_autocast)"
    return accelerator.mixed_precision


@contextlib.contextmanager
def model_build(accelerator, whole: bool = False):
    """Around building the model: under ZeRO-3 with `zero3_init_flag: false` it is built whole on every process (as
    under DDP: the same initial weights, and `model.pretrained` loads into whole tensors); DeepSpeed partitions it in
    `prepare`. Accelerate 1.15 hands transformers the DeepSpeed config whatever that flag says, and transformers
    then builds every model inside `deepspeed.zero.Init` (partitioned as it is built, initialised in another order).
    `whole`: built whole whatever the flag says: the size check's shapes-only model on the meta device, which
    `deepspeed.zero.Init` cannot build (transformers initialises its gathered weights, and meta tensors hold none)."""
    plugin = accelerator.state.deepspeed_plugin if accelerator.distributed_type == DistributedType.DEEPSPEED else None
    if plugin is None or plugin.zero_stage != 3 or (plugin.zero3_init_flag and not whole):
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()  # what Accelerate had set: the config transformers sees from here on


def safe_globals() -> list:
    """The classes besides tensors and plain data that DeepSpeed's ZeRO checkpoints hold (its optimizer states: the
    loss scaler, the ZeRO stage, the address of each parameter's fragment), for `torch.load(weights_only=True)`."""
    # imported here: DeepSpeed is optional, and only a DeepSpeed checkpoint needs it
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]
