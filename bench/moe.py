"""Speed of one mixture-of-experts layer against a dense MLP with the same active parameters and against the
per-expert one-hot loop of transformers' eager Mixtral. Prints one JSON object.

    python bench/moe.py [--tokens 4096] [--d-model 256] [--d-ffn 256] [--configs 8:2 64:4] [--repeats 7]

For each `E:k` (experts : experts per token), forward + backward (the loss is a fixed random projection of the
output; the input requires grad, as inside a network), float32, `--threads` intra-op threads:

    moe          `s4accel.models.moe.MoELayer` (router in fp32, top-k, sorted dispatch, `moe_dispatch="auto"`: on CPU
                 one matmul per expert slice), including its balance and z-loss
    moe_grouped  the same layer with `moe_dispatch="grouped_mm"` (`torch.nn.functional.grouped_mm`, the default on
                 CUDA in bf16)
    dense        a SwiGLU MLP of width k x d_ffn: the same active parameters per token, no routing
    onehot_loop  the same router and 3-D weights dispatched as transformers' eager Mixtral does: a one-hot
                 (E, k, T) mask, then for every expert that got tokens `torch.where` on its mask, gather, expert,
                 `index_add_`

Timing is paired, as in bench/s4_layer.py: one pass of each model per round in a rotating order, after a warm-up
pass each; medians over rounds and the median of the per-round ratios. Goals (issue 5): moe / dense <= 1.3, and
onehot_loop / moe >= 2 at E = 64.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from s4_layer import paired_rounds, ratio_summary, timed  # noqa: E402

from s4accel.models.configuration_moe import MoEConfig  # noqa: E402
from s4accel.models.moe import MoELayer, SwiGLUMLP  # noqa: E402

GOALS = {"moe_over_dense_at_most": 1.3, "onehot_over_moe_at_least_at_E64": 2.0}


def onehot_loop_forward(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Mixtral-style eager dispatch over `layer`'s router and weights: x (T, D) -> (T, D)."""
    E, k = layer.num_experts, layer.top_k
    logits = layer.route(x)
    weights, experts = logits.softmax(-1).topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    mask = F.one_hot(experts, E).permute(2, 1, 0)  # (E, k, T)
    out = torch.zeros_like(x)
    hit = (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    for e in hit:
        slot, token = torch.where(mask[e])
        gate, up = F.linear(x[token], layer.experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, layer.experts.down_proj[e]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


def build(args, E: int, k: int) -> dict:
    """name -> one-pass closure (forward + backward), all on the same input values."""
    T, D, Fh = args.tokens, args.d_model, args.d_ffn
    config = MoEConfig(d_model=D, d_ffn=Fh, num_experts=E, num_experts_per_tok=k, n_head=4)
    torch.manual_seed(0)
    moe = MoELayer(config, D)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    grouped = MoELayer(MoEConfig(**{**config.to_diff_dict(), "moe_dispatch": "grouped_mm"}), D)
    grouped.load_state_dict(moe.state_dict())
    dense = SwiGLUMLP(D, k * Fh)
    x0 = torch.randn(T, D)
    g = torch.randn(T, D)

    def pass_of(module, forward):
        x = x0.clone().requires_grad_()

        def run():
            for p in module.parameters():
                p.grad = None
            x.grad = None
            y = forward(x)
            (y * g).sum().backward()
        return run

    def moe_with_losses(layer):
        def forward(x):
            y, aux = layer(x)
            return y + 0 * (aux["balance_loss"] + aux["z_loss"])  # the losses' backward is part of the layer's cost
        return forward

    return {"moe": pass_of(moe, moe_with_losses(moe)), "moe_grouped": pass_of(grouped, moe_with_losses(grouped)),
            "dense": pass_of(dense, dense), "onehot_loop": pass_of(moe, lambda x: onehot_loop_forward(moe, x))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ffn", type=int, default=256, help="hidden width of each expert (dense: k x this)")
    ap.add_argument("--configs", nargs="+", default=["8:2", "64:4"], help="E:k pairs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"config": {"tokens": args.tokens, "d_model": args.d_model, "d_ffn": args.d_ffn, "dtype": "float32",
                      "threads": args.threads, "repeats": args.repeats,
                      "grouped_mm": hasattr(F, "grouped_mm")},
           "machine": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                       "loadavg_start": list(os.getloadavg())},
           "goals": GOALS, "results": {}}
    for spec in args.configs:
        E, k = map(int, spec.split(":"))
        fns = build(args, E, k)
        for fn in fns.values():
            timed(fn)  # warm-up
        times = paired_rounds(fns, {name: args.repeats for name in fns})
        entry = {"seconds_median": {n: statistics.median(t) for n, t in times.items()},
                 "moe_over_dense": ratio_summary(times, "moe", "dense"),
                 "onehot_loop_over_moe": ratio_summary(times, "onehot_loop", "moe"),
                 "moe_grouped_over_moe": ratio_summary(times, "moe_grouped", "moe")}
        out["results"][f"E{E}_k{k}"] = entry
        print(f"E={E} k={k}: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in entry["seconds_median"].items()),
              file=sys.stderr)
    out["machine"]["loadavg_end"] = list(os.getloadavg())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
