"""Run under `accelerate launch` (accelerate_configs/fsdp.yaml, --mixed_precision bf16, 2 processes) through
tests/scripts/fsdp_on_cpu.py's shim: what each FSDP2 unit computes in, seen from inside the forward pass. Rank 0
prints one JSON object: the dtypes the S4 kernel, the router and a Linear were gathered in, whether the SSM parameters
gathered for the forward equal their float32 values bit for bit (before and after an optimizer step), and each unit's
reduce dtype. With `accelerate-default`, the float32 units are not made (Accelerate's one policy for the whole model).
"""

import json
import sys

import torch

import fsdp_on_cpu  # noqa: F401  (lets Accelerate pick FSDP on CPU processes)
from accelerate import Accelerator
from s4accel import S4Config, S4ForCausalLM
from s4accel.training.devices.precision import apply_fsdp_precision

acc = Accelerator(cpu=True)
torch.manual_seed(0)
# d_state 64: S4D-Lin's Im A_n = pi n reaches 97.4, where bfloat16 steps by 0.5
model = S4ForCausalLM(S4Config(vocab_size=40, d_model=32, n_layer=2, d_state=64, ffn="moe", num_experts=4,
                               d_ffn=32))
initial = {k: v.clone() for k, v in model.state_dict().items()}
units = [] if "accelerate-default" in sys.argv[1:] else apply_fsdp_precision(acc, model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = acc.prepare(model, optimizer)

block = model.backbone.layers[0]
kernel, router, linear = block.layer.kernel, block.ffn.router, block.layer.output_linear
seen = {}


def record(name, module, tensors):
    def hook(*_):
        seen.setdefault(name, []).append({k: getattr(module, k).detach().clone() for k in tensors})
    module.register_forward_pre_hook(hook)  # after FSDP's own pre-forward hook (which gathers the parameters)


record("kernel", kernel, ["A_imag", "log_dt", "C"])
record("router", router, ["weight"])
record("linear", linear, ["weight"])

ids = torch.randint(3, 40, (2, 24))
model(input_ids=ids, labels=ids).loss.backward()
optimizer.step()
optimizer.zero_grad()
after_step = {k: getattr(kernel, k).full_tensor() for k in ("A_imag", "log_dt", "C")}  # the float32 masters
model(input_ids=ids, labels=ids).loss.backward()

first, second = seen["kernel"][0], seen["kernel"][-1]
prefix = "backbone.layers.0.layer.kernel."


def reduce_dtype(module):  # FSDP2 keeps each unit's policy on its state (private in torch 2.13)
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    return str(state._mp_policy.reduce_dtype) if state is not None else None


if acc.is_main_process:
    print(json.dumps({
        "units": units,
        "dtypes": {name: str(v[0][next(iter(v[0]))].dtype) for name, v in seen.items()},
        "ssm_exact_at_start": all(torch.equal(first[k], initial[prefix + k]) for k in first),
        "ssm_exact_after_step": all(torch.equal(second[k], after_step[k]) for k in second),
        "a_imag_max": initial[prefix + "A_imag"].abs().max().item(),
        "reduce_dtype": {"kernel": reduce_dtype(kernel), "block": reduce_dtype(block), "root": reduce_dtype(model)},
    }))
acc.wait_for_everyone()
acc.end_training()
