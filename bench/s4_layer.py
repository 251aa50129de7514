"""Speed of one S4D layer against the models it replaces, and of its recurrent decode. Prints one JSON object.

    python bench/s4_layer.py [--lengths 256 ... 16384] [--reference-dir /tmp/s4ref] [--threads 2] [--repeats 5]

What it measures (float32, CPU, `--threads` intra-op threads; default B=16, H=256, N=64):

- `layer`: seconds for one forward + backward (the loss is the output's sum; the input requires grad, as inside a
  network) of each model at each length L:
    ours        `S4Layer` (kernel="s4d", ZOH) of `s4accel/models/modeling_s4.py`
    reference   state-spaces/s4 `models/s4/s4d.py` `S4D(d_model=H, d_state=N, transposed=True)`, on its own (B, H, L)
                layout, imported from `--reference-dir` (skipped, with the reason, when absent)
    attention   a same-width causal self-attention layer: qkv and output projections around
                `scaled_dot_product_attention(is_causal=True)` with `--heads` heads
    gru         `torch.nn.GRU(H, H, batch_first=True)`
- `breakdown`: at `--breakdown-length`, the forward + backward of each piece of a layer on its own, with leaf
  inputs: the kernel `K(L)` from the SSM parameters, the FFT convolution with the D skip, and the output mixing
  (GELU, Linear, GLU). For the reference only its kernel and mixing modules are timed (calling its code); its
  convolution is the rest of its full pass.
  Also the minor page faults of one full pass of each (glibc returns large freed blocks to the OS, so each pass
  faults its buffers in again; `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` or another allocator remove
  that, and `machine.malloc_env` records which were set).
- `memory`: the largest tensor any operation creates in one forward + backward of ours (seen by a dispatch
  mode), against one (B, H, L) activation and a (B, H, N/2, L) complex tensor, which must never appear.
- `decode`: milliseconds per token of `S4Layer.step` at batch 1 and B, with the state actually stepped from zero to
  each of `--decode-positions`; the windows of `--decode-window` steps from those saved states are then timed in
  interleaved rounds. The state is O(1), so the time per token should not grow with the position.
- `generate`: milliseconds per generated token of a small `S4ForCausalLM.generate()` (2 layers, H, N) after prompts
  of `--generate-prompts` tokens, from the time between consecutive new tokens (a stopping criterion stamps
  each), so the prefill is not counted.

How it is measured. These machines run other work at the same time, so one model's time moves by tens of percent
from one second to the next. Every timing is therefore paired: at each length the models run in rounds, one pass
of each per round in a rotating order, after one warm-up pass each; the report gives each model's median over
rounds, the ratio of medians, and the median of the per-round ratios (ours / other: below 1 means ours is faster).
A baseline (attention, GRU) whose estimated time for warm-up plus the minimum rounds at a length (scaled from the
previous length: L^2 for attention, L for the GRU), or whose warm-up, does not fit `--budget-s` is skipped there,
with the reason. A slow S4 layer is never skipped but runs fewer rounds (never fewer than `--min-repeats`). The
machine's load averages at start and end are in `machine`.

The reference needs its two files exported outside this repository and `einops` and `scipy` importable:
    git clone --depth 1 https://github.com/state-spaces/s4 /tmp/s4-repo
    mkdir -p /tmp/s4ref && cp /tmp/s4-repo/models/s4/s4d.py /tmp/s4-repo/models/s4/s4.py /tmp/s4ref/
    .venv/bin/pip install einops scipy   # or: pip install --target /tmp/s4ref/site ...; PYTHONPATH=/tmp/s4ref/site
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

from s4accel.models.configuration_s4 import S4Config
from s4accel.models.modeling_s4 import S4ForCausalLM, S4Layer, fft_conv

LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
MODELS = ("ours", "reference", "attention", "gru")
BASELINES = ("attention", "gru")  # skipped where too slow; the S4 layers always run
GOAL_SPEEDUP = 1.5  # the target: ours at L=1024 at least 1.5x faster than the reference's s4d.py


# --------------------------------------------------------------------------------------------------------------------
# The reference (state-spaces/s4), imported from an exported copy. Its files import a few things of the research repo
# that a kernel does not use; those get inert stand-ins, so nothing of that repository is needed beyond the two files.


def import_reference(ref_dir: str | Path, name: str) -> types.ModuleType:
    """Import `name` ("s4d" or "s4") from `ref_dir`. Raises ImportError with the reason when it cannot."""
    ref_dir = Path(ref_dir)
    if not (ref_dir / f"{name}.py").is_file():
        raise ImportError(f"{ref_dir / (name + '.py')} not found (copy it from a clone of "
                          "github.com/state-spaces/s4, see the module docs)")
    if str(ref_dir) not in sys.path:
        sys.path.insert(0, str(ref_dir))
    _stub_missing("src.models.nn", DropoutNd=_UnusedDropoutNd)  # s4d.py: used only with dropout > 0
    _stub_missing("pytorch_lightning.utilities", rank_zero_only=lambda f: f)  # s4.py: decorates its logger
    return importlib.import_module(name)


class _UnusedDropoutNd(nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the bench builds the reference with dropout=0 and never needs its DropoutNd")


def _stub_missing(module: str, **attrs):
    """An empty module chain `a.b.c` carrying `attrs`, unless `module` imports for real."""
    try:
        importlib.import_module(module)
        return
    except ImportError:
        pass
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    for key, value in attrs.items():
        setattr(sys.modules[module], key, value)


# --------------------------------------------------------------------------------------------------------------------
# The models, each as `build(L) -> pass`: a closure that runs one forward + backward on inputs made once per length.


class CausalSelfAttention(nn.Module):
    """qkv projection, causal SDPA over `heads` heads, output projection: (B, L, H) -> (B, L, H)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, L, H / heads)
        return self.out(y.transpose(1, 2).reshape(B, L, H))


def s4d_layer(args) -> S4Layer:
    layer = S4Layer(S4Config(d_model=args.d_model, d_state=args.d_state, kernel="s4d", disc="zoh"))
    layer.kernel.reset_parameters()  # what S4PreTrainedModel._init_weights does for a layer
    nn.init.normal_(layer.D)
    return layer


def build_models(args, reference) -> dict:
    """name -> (build(L) -> one-pass closure, exponent of L in its cost), for the models in `--models`."""
    B, H = args.batch, args.d_model
    ours = s4d_layer(args)
    models = {}

    def pass_fn(module, forward, x):
        def run():
            for p in module.parameters():
                p.grad = None
            x.grad = None
            forward(x).sum().backward()
        return run

    def blh(L):
        return torch.randn(B, L, H, requires_grad=True)

    models["ours"] = (lambda L: pass_fn(ours, lambda x: ours(x)[0], blh(L)), 1)
    if reference is not None:
        ref = reference.S4D(H, d_state=args.d_state, transposed=True)
        # its native layout (B, H, L): no transposes are charged to it
        models["reference"] = (lambda L: pass_fn(ref, lambda x: ref(x)[0], torch.randn(B, H, L, requires_grad=True)),
                               1)
    attention = CausalSelfAttention(H, args.heads)
    models["attention"] = (lambda L: pass_fn(attention, attention, blh(L)), 2)
    gru = nn.GRU(H, H, batch_first=True)
    models["gru"] = (lambda L: pass_fn(gru, lambda x: gru(x)[0], blh(L)), 1)
    return {name: models[name] for name in args.models if name in models}


# --------------------------------------------------------------------------------------------------------------------
# Paired timing


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired_rounds(fns: dict, rounds: dict) -> dict:
    """Run `rounds[name]` passes of each closure in `fns`, one per round, rotating the order: name -> [seconds]."""
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(max(rounds.values(), default=0)):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if len(times[name]) < rounds[name]:
                times[name].append(timed(fns[name]))
    return times


def ratio_summary(times: dict, a: str, b: str) -> dict | None:
    """a over b: the ratio of medians and the median of the per-round ratios (rounds where both ran)."""
    if not times.get(a) or not times.get(b):
        return None
    paired = [x / y for x, y in zip(times[a], times[b])]
    return {"of_medians": statistics.median(times[a]) / statistics.median(times[b]),
            "paired_median": statistics.median(paired)}


def bench_layers(args, models: dict, unavailable: dict) -> dict:
    """Paired rounds at each length. The S4 layers always run (with fewer rounds when slow); a baseline is skipped
    where its estimated or warm-up time would not fit `--budget-s`."""
    out, last = {}, {}  # last[name] = (L, seconds per pass) for the estimates
    for L in args.lengths:
        fns, skipped, rounds = {}, {}, {}
        for name, (build, power) in models.items():
            if name in BASELINES and name in last:
                L0, t0 = last[name]
                estimate = t0 * (L / L0) ** power
                if estimate * (1 + args.min_repeats) > args.budget_s:
                    skipped[name] = (f"estimated {estimate:.1f} s per pass at L={L} (from {t0:.2f} s at L={L0}), "
                                     f"x{1 + args.min_repeats} passes > --budget-s {args.budget_s:g}")
                    continue
            fns[name] = build(L)
        for name in list(fns):  # warm-up (first-call costs, allocator), and a measure of the pass
            warm = timed(fns[name])
            if name in BASELINES and warm * args.min_repeats > args.budget_s:
                skipped[name] = f"warm-up pass took {warm:.1f} s: {args.min_repeats} more > --budget-s"
                last[name] = (L, warm)
                del fns[name]
                continue
            rounds[name] = max(args.min_repeats, min(args.repeats, int(args.budget_s / max(warm, 1e-9)) - 1))
        times = paired_rounds(fns, rounds)
        for name, ts in times.items():
            last[name] = (L, statistics.median(ts))
        entry = {"seconds_median": {name: statistics.median(ts) for name, ts in times.items()},
                 "rounds": {name: len(ts) for name, ts in times.items()},
                 "skipped": {**skipped, **unavailable}}
        entry["ours_over"] = {b: ratio_summary(times, "ours", b) for b in MODELS if b != "ours"}
        out[str(L)] = entry
        del fns
        print(f"L={L}: " + ", ".join(f"{k} {v:.3f}s" for k, v in entry["seconds_median"].items()), file=sys.stderr)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Breakdown of a layer's forward + backward into kernel generation, FFT convolution (with D) and output mixing


def breakdown(args, reference) -> dict:
    B, H, L = args.batch, args.d_model, args.breakdown_length
    layer = s4d_layer(args)
    g_K = torch.randn(1, H, L)
    K_leaf = layer.kernel(L).detach().requires_grad_()
    u_leaf = torch.randn(B, H, L, requires_grad=True)  # (B, H, L): the layer's transposed input
    D_leaf = layer.D.detach().clone().requires_grad_()
    y_leaf = torch.randn(B, L, H, requires_grad=True)
    x = torch.randn(B, L, H, requires_grad=True)

    def backward_of(f):
        def run():
            out = f()
            out.backward(g_K if out.shape == g_K.shape else torch.ones_like(out))
        return run

    pieces = {
        "ours.kernel": backward_of(lambda: layer.kernel(L)),
        "ours.conv": backward_of(lambda: fft_conv(u_leaf, K_leaf, D_leaf)),  # D is the tap at lag 0
        "ours.mix": backward_of(lambda: layer._mix(y_leaf)),
        "ours.full": backward_of(lambda: layer(x)[0]),
    }
    if reference is not None:
        ref = reference.S4D(H, d_state=args.d_state, transposed=True)
        y_ref = torch.randn(B, H, L, requires_grad=True)
        pieces["reference.kernel"] = backward_of(lambda: ref.kernel(L=L)[None])
        pieces["reference.mix"] = backward_of(lambda: ref.output_linear(ref.activation(y_ref)))
        pieces["reference.full"] = backward_of(lambda: ref(u_leaf)[0])
    for fn in pieces.values():
        fn()
    times = paired_rounds(pieces, {name: args.repeats for name in pieces})
    med = {name: statistics.median(ts) for name, ts in times.items()}
    out = {"length": L, "seconds_median": {}}
    for impl in ("ours", "reference"):
        parts = {k.split(".")[1]: v for k, v in med.items() if k.startswith(impl + ".")}
        if not parts:
            continue
        if impl == "reference":
            parts["conv"] = parts["full"] - parts["kernel"] - parts["mix"]  # the rest: its FFT convolution and D
        parts["sum_of_parts"] = parts["kernel"] + parts["conv"] + parts["mix"]
        parts["share_of_sum"] = {k: parts[k] / parts["sum_of_parts"] for k in ("kernel", "conv", "mix")}
        out["seconds_median"][impl] = parts
    out["note"] = ("each piece timed alone with leaf inputs; full = the whole layer; reference.conv = full - kernel - "
                   "mix (its convolution is not timed by itself)")
    # glibc hands large freed blocks back to the OS, so every pass faults its buffers in again (zeroed pages): a
    # cost outside any op, which a tuned allocator (MALLOC_* variables, see `machine`) removes.
    out["minor_page_faults_per_full_pass"] = {name.split(".")[0]: page_faults(fn)
                                              for name, fn in pieces.items() if name.endswith(".full")}
    return out


def page_faults(fn) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


# --------------------------------------------------------------------------------------------------------------------
# No (B, H, N, L) tensor: the largest tensor any aten op creates in one forward + backward


def largest_tensor(fn) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        best = (0, None, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    size = t.numel() * t.element_size()
                    if size > self.best[0]:
                        self.best = (size, tuple(t.shape), str(func))
            return out

    with Largest() as mode:
        fn()
    return {"bytes": mode.best[0], "shape": list(mode.best[1] or ()), "op": mode.best[2]}


def memory_check(args) -> dict:
    B, H, N, L = args.batch, args.d_model, args.d_state, args.breakdown_length
    layer = s4d_layer(args)
    x = torch.randn(B, L, H, requires_grad=True)
    activation = B * H * L * 4  # one float32 (B, H, L) tensor
    bhnl = B * H * (N // 2) * L * 8  # a complex64 (B, H, N/2, L) tensor
    out = {"length": L, "activation_bytes": activation, "bhnl_complex_bytes": bhnl}
    big = largest_tensor(lambda: layer(x)[0].sum().backward())
    big["over_activation"] = big["bytes"] / activation
    out["ours"] = big
    out["no_BHNL_tensor"] = big["bytes"] < bhnl
    return out


# --------------------------------------------------------------------------------------------------------------------
# Recurrent decode: time per token from states stepped to each position


@torch.no_grad()
def decode(args) -> dict:
    layer = s4d_layer(args).eval()
    params = layer.kernel.step_params()
    positions, W = sorted(args.decode_positions), args.decode_window
    out = {"window_steps": W, "positions": positions}
    for batch in sorted({1, args.batch}):
        inputs = torch.randn(W, batch, args.d_model)
        state = layer.kernel.zero_state(batch, inputs)
        saved, t0 = {}, time.perf_counter()
        for k in range(positions[-1]):  # actually step to every position, keeping the state there
            if k in positions:
                saved[k] = state.clone()
            _, state = layer.step(inputs[k % W], state, params)
        saved[positions[-1]] = state.clone()
        stepping = (time.perf_counter() - t0) / positions[-1]

        def window(start, inputs=inputs):
            def run():
                x = start.clone()
                for u in inputs:
                    _, x = layer.step(u, x, params)
            return run

        fns = {p: window(saved[p]) for p in positions}
        for fn in fns.values():
            fn()
        times = paired_rounds(fns, {p: args.repeats for p in positions})
        ms = {str(p): 1e3 * statistics.median(ts) / W for p, ts in times.items()}
        out[f"batch_{batch}"] = {"ms_per_token": ms, "last_over_first": ms[str(positions[-1])] / ms[str(positions[0])],
                                 "ms_per_token_while_stepping_to_last": 1e3 * stepping,
                                 "state_shape": list(state.shape)}
    return out


@torch.no_grad()
def generate(args) -> dict:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Stamp(StoppingCriteria):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores, **kwargs):
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    torch.manual_seed(0)
    config = S4Config(d_model=args.d_model, n_layer=2, d_state=args.d_state, vocab_size=259)
    model = S4ForCausalLM(config).eval()
    new = args.generate_tokens
    out = {"layers": 2, "new_tokens": new, "ms_per_token": {}, "prefill_s": {}}

    def run(prompt_len):
        ids = torch.randint(2, 259, (1, prompt_len))
        stamp = Stamp()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, stopping_criteria=StoppingCriteriaList([stamp]))
        gaps = [b - a for a, b in zip(stamp.stamps, stamp.stamps[1:])]  # one recurrent step each
        return stamp.stamps[0] - t0, statistics.median(gaps)

    per, prefill = {p: [] for p in args.generate_prompts}, {p: [] for p in args.generate_prompts}
    for r in range(args.min_repeats):
        for p in args.generate_prompts[r % 2:] + args.generate_prompts[: r % 2]:
            pre, gap = run(p)
            prefill[p].append(pre)
            per[p].append(gap)
    for p in args.generate_prompts:
        out["ms_per_token"][str(p)] = 1e3 * statistics.median(per[p])
        out["prefill_s"][str(p)] = statistics.median(prefill[p])
    first, last = (str(p) for p in (args.generate_prompts[0], args.generate_prompts[-1]))
    out["last_over_first"] = out["ms_per_token"][last] / out["ms_per_token"][first]
    return out


# --------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-state", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4, help="attention heads (must divide --d-model)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per configuration (default: 5)")
    ap.add_argument("--min-repeats", type=int, default=3, help="fewest rounds a slow model is cut down to")
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="seconds a baseline may take at one length (warm-up + rounds); slower ones are skipped")
    ap.add_argument("--reference-dir", type=Path, help="exported state-spaces/s4 models/s4 files (s4d.py)")
    ap.add_argument("--breakdown-length", type=int, default=1024)
    ap.add_argument("--decode-positions", type=int, nargs="+", default=[64, 512, 2048, 8192])
    ap.add_argument("--decode-window", type=int, default=64, help="steps timed from each position")
    ap.add_argument("--generate-prompts", type=int, nargs="+", default=[64, 8192])
    ap.add_argument("--generate-tokens", type=int, default=32)
    ap.add_argument("--skip", nargs="*", default=[], choices=["layer", "breakdown", "memory", "decode", "generate"])
    args = ap.parse_args(argv)
    args.min_repeats = min(args.min_repeats, args.repeats)
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    reference, reference_note = None, "no --reference-dir given: the reference is skipped"
    if args.reference_dir is not None:
        try:
            reference = import_reference(args.reference_dir, "s4d")
            reference_note = f"state-spaces/s4 models/s4/s4d.py from {args.reference_dir}"
        except ImportError as e:
            reference_note = f"reference skipped: {e}"
    result = {
        "config": {"batch": args.batch, "d_model": args.d_model, "d_state": args.d_state, "heads": args.heads,
                   "dtype": "float32", "threads": args.threads, "repeats": args.repeats,
                   "min_repeats": args.min_repeats, "budget_s": args.budget_s, "lengths": args.lengths,
                   "reference": reference_note},
        "machine": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_start": list(os.getloadavg()),
                    "malloc_env": {k: v for k, v in os.environ.items()
                                   if k.startswith("MALLOC_") or k == "LD_PRELOAD"}},
    }
    unavailable = {"reference": reference_note} if reference is None and "reference" in args.models else {}
    sections = {"layer": lambda: bench_layers(args, build_models(args, reference), unavailable),
                "breakdown": lambda: breakdown(args, reference), "memory": lambda: memory_check(args),
                "decode": lambda: decode(args), "generate": lambda: generate(args)}
    for name, section in sections.items():
        if name not in args.skip:
            t0 = time.perf_counter()
            result[name] = section()
            print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if "layer" in result:
        at = result["layer"].get(str(args.breakdown_length), {}).get("seconds_median", {})
        if "reference" in at:
            result["speedup_over_reference"] = {"length": args.breakdown_length, "goal": GOAL_SPEEDUP,
                                                "ours": at["reference"] / at["ours"]}
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
