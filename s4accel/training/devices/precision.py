"""The precision policy of FSDP2 mixed precision: float32 where half precision breaks the model, half precision for
the rest, and every gradient reduction in float32.

Accelerate's FSDP2 with `mixed_precision: bf16` builds one `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=bf16)` for the whole model: every parameter is all-gathered in bf16 and every gradient reduced in bf16.
For S4 that rounds the SSM parameters before the layer (which computes in float32) ever sees them: Im A reaches ~100
at d_state 64, where bf16 steps by 0.5, and `log_dt` and `C` lose digits the same way; a MoE router's softmax
decides the routing from logits rounded alike. torch's `fully_shard` takes a policy per module, so the modules a
model names in `_keep_in_fp32_modules_strict` (transformers' own list of what stays float32 when a model is loaded
in half precision) become FSDP units of their own with a float32 policy before Accelerate shards the rest, and the
rest reduces its gradients in float32 (summing bf16 gradients over many processes loses their low bits; torchtitan
reduces in float32 by default too).
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType

from ...errors import RecipeError

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def float32_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules `_keep_in_fp32_modules_strict` names (by the last part of their qualified name) that hold
    parameters, outermost first; none inside another."""
    names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in names and any(True for _ in module.parameters()):
            if not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, module))
    return found


def along_longest_dim(param: torch.nn.Parameter):
    """Shard a float32 unit's parameter along its longest dimension, so that no process holds an empty shard (S4's
    `C (1, H, N/2, 2)` sharded along its first one would be empty on every process but one): Accelerate's `prepare`
    finds each optimizer parameter again by the address of its local shard, and empty shards all have address 0.
    (A module with a parameter shorter than the number of processes everywhere stays in its block's unit.)"""
    from torch.distributed.tensor import Shard

    return Shard(max(range(param.ndim), key=lambda d: param.shape[d]))


def apply_fsdp_precision(accelerator, model: torch.nn.Module) -> list[str]:
    """Under FSDP2 with bf16/fp16 mixed precision: the float32 units, then the plugin's policy for the rest
    (half-precision parameters, float32 reductions). Call before `accelerator.prepare`, which shards the rest around
    them. Returns the qualified names of the float32 units (empty when nothing applies)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    half = HALF.get(accelerator.mixed_precision)
    if accelerator.distributed_type != DistributedType.FSDP or plugin is None or plugin.fsdp_version != 2 or not half:
        return []
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32,
                                                         output_dtype=half)
    full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mesh = getattr(accelerator, "torch_device_mesh", None)  # as Accelerate shards the rest
    if mesh is not None:
        mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    world = accelerator.num_processes
    units = [(name, m) for name, m in float32_modules(model) if all(max(p.shape) >= world for p in m.parameters())]
    for _, module in units:
        fully_shard(module, mp_policy=full, reshard_after_forward=plugin.reshard_after_forward,
                    offload_policy=plugin.cpu_offload, mesh=mesh, shard_placement_fn=along_longest_dim)
        for method in getattr(module, "fsdp_forward_methods", ()):  # they read the parameters outside forward too
            register_fsdp_forward_method(module, method)
    return [name for name, _ in units]


def convolution_line(model: torch.nn.Module, accelerator, rows: int | None = None) -> str | None:
    """The line a run prints about its S4 layers' convolution (the path, its operand dtype and chunk, as the model
    chooses them for this device and precision), or None for a model without S4 layers. `rows`: a micro-batch's
    rows, when known and the step compiled (the compiled fused path can cut the rows of short batches into
    segments: `s4d_segments.UNDER_COMPILE`)."""
    from ...models import s4d_segments
    from ...models.modeling_s4 import conv_plan

    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "s4accel-s4":
        return None
    dtype = next((p.dtype for n, p in model.named_parameters() if ".kernel." not in n), torch.float32)
    device = accelerator.device.type
    try:
        plan = conv_plan(config, device, dtype, HALF.get(accelerator.mixed_precision))
    except ValueError as e:  # a path forced where it cannot run: one line naming the key
        raise RecipeError(f"model.overrides.{e}") from None  # e: "conv_path='fused' cannot run here: ..."
    how = "forced by" if config.conv_path != "auto" else "chosen for " + device + " by"
    line = f"S4 convolution: {plan.describe()}, {how} model.overrides.conv_path={config.conv_path}"
    if plan.path == "fused" and rows and s4d_segments.UNDER_COMPILE and s4d_segments.segments(rows) > 1:
        line += f"; batches of {rows} rows: each row cut into segments, read as rows by the kernels"
    return line
