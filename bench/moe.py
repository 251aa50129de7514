"""Speed of one mixture-of-experts layer against a dense MLP with the same active parameters and against the
per-expert one-hot loop of transformers' eager Mixtral. Prints one JSON object.

    python bench/moe.py [--tokens 4096] [--d-model 256] [--d-ffn 256] [--configs 8:2 64:4] [--repeats 7]
                        [--allocator train|glibc] [--device cpu|cuda] [--dtype float32|bfloat16]

For each `E:k` (experts : experts per token), forward + backward (the loss is a fixed random projection of the
output; the input requires grad, as inside a network), in float32 or under bf16 autocast (`--dtype`), on `--device`
(CUDA passes end with a synchronize), `--threads` intra-op threads:

    moe          `s4accel.models.moe.MoELayer` (router in fp32, top-k, sorted dispatch, `moe_dispatch="auto"`: on CPU
                 the `fused` experts function), including its balance and z-loss
    moe_grouped  the same layer with `moe_dispatch="grouped_mm"` (`torch.nn.functional.grouped_mm`, the default on
                 CUDA in bf16)
    moe_loop     the same layer with `moe_dispatch="loop"`: one `F.linear` pair per expert slice, plain autograd
    dense        a SwiGLU MLP of width k x d_ffn: the same active parameters per token, no routing
    onehot_loop  the same router and 3-D weights dispatched as transformers' eager Mixtral does: a one-hot
                 (E, k, T) mask, then for every expert that got tokens `torch.where` on its mask, gather, expert,
                 `index_add_`
    matmuls_only not a layer: the six matmuls per expert slice of one forward + backward (two forward, the input
                 gradient and the weight gradient of each) on the slices this router gives, into preallocated
                 buffers, with nothing else: the matmul part of the floor below
    routing_only the same `MoELayer` with its experts replaced by a stub that costs nothing: router, softmax, top-k,
                 pair sort, counts, balance and z losses, and their backward, exactly as the layer runs them
    dense_matmuls_only  the dense MLP's six matmuls alone, likewise
    harness      the timing harness alone on a layer that does nothing: the loss projection of a (T, D) output and
                 its backward, which every layer's pass above includes (not the `*matmuls_only` rows)
    moe_compiled_routing, routing_only_compiled
                 `moe_grouped` and `routing_only` with the routing compiled (`moe.COMPILE_ROUTING = "always"`: softmax,
                 top-k, the static row layout and the losses as one compiled graph; the rest eager). The cells above
                 route eagerly (`"never"`), also on CUDA, where the layer's default compiles its routing
    moe_compiled_experts
                 `moe_grouped` with its routing and experts compiled together (`moe.COMPILE_EXPERTS = "always"`: the
                 routing, gathers, grouped matmuls and k-way sums as one graph; the router's matmul eager)
    moe_torch_ops
                 `moe_grouped` with PyTorch's operators for its k-way sums, weighted SwiGLU and router with the
                 experts' cast (`moe_kernels.MOE_KERNELS = "never"`), where the other cells take the Triton
                 kernels on CUDA (the default there; on CPU both are PyTorch's): `kernels_over_torch_ops` compares
                 them
    moe_torch_router
                 `moe_grouped` with PyTorch's router and the experts' own cast (`moe_kernels.ROUTER_MAX_EXPERTS =
                 0`), its other kernels as the default: `router_kernel_over_torch` compares them

`floor_over_dense` = (matmuls_only + routing_only - harness + dense - dense_matmuls_only) / dense, from the medians:
the expert matmuls, the routing, and the same SwiGLU elementwise work as the dense MLP (the same number of elements),
with the gathers, scatter-adds and routing weights counted as free and the harness counted once. No dispatch that
runs one matmul per expert slice and eager PyTorch elementwise ops can beat it on this machine; above 1.3 the
moe / dense goal is out of reach for all of them.

Timing is paired, as in bench/s4_layer.py: one pass of each model per round in a rotating order, after a warm-up
pass each; medians over rounds and the median of the per-round ratios. A variant that fails on this device or dtype
(e.g. `grouped_mm` where torch has no kernel for it) is reported under `unavailable` and left out. Goals (issue 5):
moe / dense <= 1.3, and onehot_loop / moe >= 2 at E = 64.

`--allocator train` (the default) first applies `s4accel.allocator.keep_freed_memory()`, as `s4accel train` does, so
the figures are those of a training run; `glibc` leaves the C allocator at its defaults (each large temporary is
mmapped and page-faulted in again on every pass, which costs the dense MLP's few big buffers most).
"""

from __future__ import annotations

import argparse
import copy
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

from s4accel.allocator import keep_freed_memory  # noqa: E402
from s4accel.models.configuration_moe import MoEConfig  # noqa: E402
from s4accel.models import moe as moe_module  # noqa: E402
from s4accel.models import moe_kernels  # noqa: E402
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


# Each CUDA pass ends waiting for the GPU, so that this script's host clock times it; bench/gpu_speed.py, which
# times the same passes with CUDA events (and also back to back), turns it off.
SYNC_EACH_PASS = True


def synchronize(device: torch.device) -> None:
    if device.type == "cuda" and SYNC_EACH_PASS:
        torch.cuda.synchronize(device)


def slice_matmuls(w1: torch.Tensor, w2: torch.Tensor, sizes: list[int], dtype: torch.dtype):
    """The six matmuls alone of a SwiGLU forward + backward per slice (`sizes[e]` rows through `w1[e] (2F, D)`,
    `w2[e] (D, F)`), in `dtype`: a closure. Weight gradients are allocated fresh each pass, as a backward does; every
    other buffer is reused."""
    w1, w2 = w1.detach().to(dtype), w2.detach().to(dtype)
    P, D, Fh = sum(sizes), w1.shape[-1], w2.shape[-1]
    new = dict(device=w1.device, dtype=dtype)
    xs, gy, a, gh = (torch.randn(P, n, **new) for n in (D, D, Fh, 2 * Fh))
    h, y, ga, gx = (torch.empty(P, n, **new) for n in (2 * Fh, D, Fh, D))
    slices = [(e, slice(end - n, end)) for e, (n, end) in enumerate(zip(sizes, torch.tensor(sizes).cumsum(0).tolist()))
              if n]

    def run():
        g1, g2 = torch.empty_like(w1), torch.empty_like(w2)
        for e, s in slices:
            torch.mm(xs[s], w1[e].t(), out=h[s])
            torch.mm(a[s], w2[e].t(), out=y[s])
        for e, s in slices:
            torch.mm(gy[s], w2[e], out=ga[s])
            torch.mm(gy[s].t(), a[s], out=g2[e])
            torch.mm(gh[s].t(), xs[s], out=g1[e])
            torch.mm(gh[s], w1[e], out=gx[s])
        synchronize(w1.device)
    return run


def expert_matmuls(layer: MoELayer, x: torch.Tensor, dtype: torch.dtype):
    """`slice_matmuls` over `layer`'s experts (E, 2F, D), (E, D, F) on the slices its router gives `x`."""
    with torch.no_grad():
        experts = layer.route(x).topk(layer.top_k, dim=-1).indices.reshape(-1)
        sizes = torch.bincount(experts, minlength=layer.num_experts).tolist()
    return slice_matmuls(layer.experts.gate_up_proj, layer.experts.down_proj, sizes, dtype)


def dense_matmuls(dense: SwiGLUMLP, x: torch.Tensor, dtype: torch.dtype):
    """`slice_matmuls` of the dense MLP: one slice of all of `x`'s rows through its (2H, D), (D, H) weights."""
    return slice_matmuls(dense.gate_up_proj.weight[None], dense.down_proj.weight[None], [x.shape[0]], dtype)


class NoExperts(torch.nn.Module):
    """Stands in for `MoEExperts` in `routing_only`: no work, but the routing weights get a gradient; the layer lays
    its pairs out as it does for the experts it replaces (sorted pairs, or `grouped_mm`'s static rows)."""

    def forward(self, x, token=None, weight=None, counts=None, rows=None):
        return (weight if rows is None else rows[-1]).sum().expand_as(x)


def build(args, E: int, k: int, compiled: bool = False) -> dict:
    """name -> one-pass closure (forward + backward), all on the same input values. `compiled`: also the MoE layer
    (with its losses) and the dense SwiGLU under `torch.compile`, as `train.compile` runs them inside a block."""
    T, D, Fh = args.tokens, args.d_model, args.d_ffn
    config = MoEConfig(d_model=D, d_ffn=Fh, num_experts=E, num_experts_per_tok=k, n_head=4)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    moe = MoELayer(config, D)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    variants = {}
    for dispatch in ("grouped_mm", "loop"):
        variants[dispatch] = MoELayer(MoEConfig(**{**config.to_diff_dict(), "moe_dispatch": dispatch}), D)
        variants[dispatch].load_state_dict(moe.state_dict())
    dense = SwiGLUMLP(D, k * Fh)
    for module in (moe, dense, *variants.values()):
        module.to(device)  # float32 master weights; bf16 runs under autocast, as training does
    x0 = torch.randn(T, D, device=device)
    g = torch.randn(T, D, device=device)

    def pass_of(module, forward):
        x = x0.clone().requires_grad_()

        def run():
            for p in module.parameters():
                p.grad = None
            x.grad = None
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                y = forward(x)
            (y.float() * g).sum().backward()
            synchronize(device)
        return run

    def routing_mode(run, routing: str, experts: str = "never", kernels: str | None = None,
                     router_max: int | None = None):
        def timed():
            saved = (moe_module.COMPILE_ROUTING, moe_module.COMPILE_EXPERTS, moe_kernels.MOE_KERNELS,
                     moe_kernels.ROUTER_MAX_EXPERTS)
            moe_module.COMPILE_ROUTING, moe_module.COMPILE_EXPERTS = routing, experts
            moe_kernels.MOE_KERNELS = saved[2] if kernels is None else kernels
            moe_kernels.ROUTER_MAX_EXPERTS = saved[3] if router_max is None else router_max
            try:
                run()
            finally:
                (moe_module.COMPILE_ROUTING, moe_module.COMPILE_EXPERTS, moe_kernels.MOE_KERNELS,
                 moe_kernels.ROUTER_MAX_EXPERTS) = saved
        return timed

    def compiled_routing(run):
        return routing_mode(run, "always")

    def eager_routing(run):  # the eager cells stay eager where the defaults compile (on CUDA)
        return routing_mode(run, "never")

    def moe_with_losses(layer):
        def forward(x):
            y, aux = layer(x)
            return y + 0 * (aux["balance_loss"] + aux["z_loss"])  # the losses' backward is part of the layer's cost
        return forward

    grouped, loop = variants["grouped_mm"], variants["loop"]
    routing = copy.deepcopy(moe)
    routing.experts = NoExperts()
    routing_grouped = copy.deepcopy(grouped)
    routing_grouped.experts = NoExperts()
    return {"moe": eager_routing(pass_of(moe, moe_with_losses(moe))),
            "moe_grouped": eager_routing(pass_of(grouped, moe_with_losses(grouped))),
            "moe_loop": pass_of(loop, moe_with_losses(loop)), "dense": pass_of(dense, dense),
            "onehot_loop": pass_of(moe, lambda x: onehot_loop_forward(moe, x)),
            "matmuls_only": expert_matmuls(moe, x0, dtype),
            "routing_only": eager_routing(pass_of(routing, moe_with_losses(routing))),
            "dense_matmuls_only": dense_matmuls(dense, x0, dtype),
            "harness": pass_of(torch.nn.Module(), lambda x: x + 0),
            "moe_compiled_routing": compiled_routing(pass_of(grouped, moe_with_losses(grouped))),
            "routing_only_compiled": compiled_routing(pass_of(routing_grouped, moe_with_losses(routing_grouped))),
            "moe_compiled_experts": routing_mode(pass_of(grouped, moe_with_losses(grouped)), "never", "always"),
            "moe_torch_ops": routing_mode(pass_of(grouped, moe_with_losses(grouped)), "never", kernels="never"),
            "moe_torch_router": routing_mode(pass_of(grouped, moe_with_losses(grouped)), "never", router_max=0),
            **({"moe_compiled": pass_of(moe, torch.compile(moe_with_losses(moe))),
                "dense_compiled": pass_of(dense, torch.compile(dense))} if compiled else {})}


def floor_over_dense(medians: dict) -> float | None:
    """(matmuls_only + routing_only - harness + dense - dense_matmuls_only) / dense: see the module docstring."""
    parts = ("matmuls_only", "routing_only", "harness", "dense", "dense_matmuls_only")
    if not all(p in medians for p in parts):
        return None
    return (medians["matmuls_only"] + medians["routing_only"] - medians["harness"] + medians["dense"]
            - medians["dense_matmuls_only"]) / medians["dense"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ffn", type=int, default=256, help="hidden width of each expert (dense: k x this)")
    ap.add_argument("--configs", nargs="+", default=["8:2", "64:4"], help="E:k pairs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--allocator", choices=["train", "glibc"], default="train",
                    help="train: keep freed memory as `s4accel train` does; glibc: the C allocator's defaults")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="bfloat16: the passes run under autocast with float32 weights")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kept = keep_freed_memory() if args.allocator == "train" else False
    device = torch.device(args.device)
    out = {"config": {"tokens": args.tokens, "d_model": args.d_model, "d_ffn": args.d_ffn, "dtype": args.dtype,
                      "device": args.device,
                      "threads": args.threads, "repeats": args.repeats, "allocator": args.allocator,
                      "keep_freed_memory_applied": kept,
                      "grouped_mm": hasattr(F, "grouped_mm")},
           "machine": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                       "loadavg_start": list(os.getloadavg()),
                       "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
           "goals": GOALS, "results": {}}
    for spec in args.configs:
        E, k = map(int, spec.split(":"))
        fns, unavailable = build(args, E, k), {}
        for name, fn in list(fns.items()):
            try:
                timed(fn)  # warm-up
            except (RuntimeError, NotImplementedError) as e:  # no kernel for this variant here
                unavailable[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                del fns[name]
        times = paired_rounds(fns, {name: args.repeats for name in fns})
        entry = {"seconds_median": {n: statistics.median(t) for n, t in times.items()}, "unavailable": unavailable,
                 "moe_over_dense": ratio_summary(times, "moe", "dense"),
                 "onehot_loop_over_moe": ratio_summary(times, "onehot_loop", "moe"),
                 "moe_grouped_over_moe": ratio_summary(times, "moe_grouped", "moe"),
                 "moe_loop_over_moe": ratio_summary(times, "moe_loop", "moe"),
                 "compiled_routing_over_eager": ratio_summary(times, "moe_compiled_routing", "moe_grouped"),
                 "compiled_experts_over_eager": ratio_summary(times, "moe_compiled_experts", "moe_grouped"),
                 "kernels_over_torch_ops": ratio_summary(times, "moe_grouped", "moe_torch_ops"),
                 "router_kernel_over_torch": ratio_summary(times, "moe_grouped", "moe_torch_router"),
                 "matmuls_only_over_dense": ratio_summary(times, "matmuls_only", "dense")}
        entry["floor_over_dense"] = floor_over_dense(entry["seconds_median"])
        out["results"][f"E{E}_k{k}"] = entry
        print(f"E={E} k={k}: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in entry["seconds_median"].items()),
              file=sys.stderr)
    out["machine"]["loadavg_end"] = list(os.getloadavg())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
