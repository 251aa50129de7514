"""The GPU speed table: one S4 layer against attention, and ~100M language models (S4D, the dense transformer, MoE),
eager and compiled. Writes a dated Markdown file and its JSON, naming the device, versions, commit and every shape:

    python bench/gpu_speed.py [--out-dir bench/results] [--budget-s 420] [--commit HASH] [--reference-dir DIR]
    python bench/gpu_speed.py --device cpu --quick       # a dry run of the script itself on tiny shapes

What it times (CUDA events around each pass, after warm-up passes; the median of the timed ones):

layer   forward + backward of one layer, B 64, H 768, N 64, under bf16 autocast, on a float32 input (what a layer
        norm hands it) with a random output gradient, at L 1K, 4K, 16K: `S4Layer` on the fused path (one Triton
        kernel each way) and the chunked path (batched matmuls), eager and under `torch.compile`; on the FFT
        path (float32 FFTs of length 2L: the CPU path, and the GPU path before the chunked one), and a causal
        attention layer of the same width (qkv and output projections around
        `scaled_dot_product_attention`, 12 heads). Peak memory of each pass (the inputs included).
chunks  the chunked path with chunks of 64 to 512 steps at each L: what the default chunk was chosen from.
fused_sweep  the fused kernel's chunk, rows and warps per program at each L: what its defaults were chosen from.
s4d_vs_dense  the S4D and dense language models at --model-lengths, compiled (their best mode); s4d_paths: the S4D
        model on the chunked path, compiled and eager (the comparison of the two S4 paths within one run).
fp32    the same layer without autocast at L 1K and 4K: chunked (float32 matmuls, then with TF32 allowed), the FFT
        path, and state-spaces/s4's `s4d.py` from `--reference-dir` as it runs by default (its 1x1 Conv1d in TF32:
        cuDNN's default), on its own (B, H, L) layout.
models  a training step (forward, backward, fused AdamW, bf16 autocast, 32,768 tokens a step) of three ~100M language
        models with a vocabulary of 32,000, d_model 768, 12 blocks: S4D with a SwiGLU MLP of width 2048 in each
        block; the dense transformer of the same shape (the MoE family with use_moe false, 12 heads, SDPA); and the
        MoE transformer (8 experts of width 1024, top-2: the dense MLP's active FLOPs). At L 1K to 16K (batch
        32,768 / L), eager and compiled (as `train.compile` does: Accelerate's regional compilation of the blocks,
        and the loss compiled beside them).
        Tokens/s, MFU as `s4accel.training.observe.flops` counts it (against the GPU's published bf16 peak), peak
        memory.
profile the CUDA kernels of one pass of the layer at L 1K (eager and compiled) and of a compiled training step of
        the S4D and the dense models at L 2,048, summed by kind (the fused kernels, matmuls, inductor's fusions,
        attention, the loss...), beside the pass's wall time and the number of kernels launched (profile_longest:
        the two models at the longest model length).
short_batches  one fused layer at the batch a model step has where it is short (B 4 at L 8K, 2 at 16K), chunks
        of 64 and 128 steps, and its rows cut into segments by the kernels.

Everything runs in priority order within `--budget-s` seconds (the lease of a GPU is short): what did not fit is
listed in the file as not measured. The JSON holds every sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM  # noqa: E402
from s4accel.models.kernel_trials import trial_failures  # noqa: E402
from s4accel.models.modeling_s4 import S4Layer  # noqa: E402
from s4accel.training.observe.flops import peak_tflops, step_flops  # noqa: E402
from s4_layer import CausalSelfAttention  # noqa: E402  (the same attention layer as the CPU bench's)

LAYER_LENGTHS = (1024, 4096, 16384)
MODEL_LENGTHS = (1024, 2048, 4096, 8192, 16384)
CHUNKS = (64, 128, 256, 512)
# (T, (rows, warps) of the forward, (rows, warps) of the backward)
FUSED_CONFIGS = tuple((T, (16, 4), b) for T in (64, 128) for b in ((16, 4), (16, 8), (32, 8)))
TOKENS = 32768


class Bench:
    """Timing with a deadline: `run(key, build)` measures `build()`'s pass unless the budget is spent."""

    def __init__(self, args):
        self.args = args
        self.device = args.device
        self.quick = args.quick  # a dry run of the script: one pass a cell shows it runs, and costs a fifth
        self.deadline = time.perf_counter() + args.budget_s
        self.results: dict = {}
        self.skipped: list[str] = []
        from s4accel.models import s4d_fused
        self.fused_defaults = (s4d_fused.LAUNCH["forward"], s4d_fused.LAUNCH["backward"])

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time_pass(self, fn, warmup: int = 2, seconds: float = 1.5, most: int = 20, back_to_back: bool = False) -> dict:
        """Median of timed passes (CUDA events), after `warmup` passes; as many as fit in `seconds` (3 to `most`).
        Each pass starts on an idle GPU (the host waits for the one before), so a pass's time includes the GPU's wait
        for the host's first launches. `back_to_back` (CUDA): also `ms_back_to_back`, the median over three groups
        of passes launched one after the other with no wait between them, each group's time over its passes: what
        a pass costs where the host runs ahead of the GPU, as it does between the layers of a model."""
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if self.quick:
            warmup, seconds, most = 1, 0.0, 1
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        self.sync()
        first = (time.perf_counter() - t0) / warmup
        reps = max(min(3, most), min(most, int(seconds / max(first, 1e-4))))
        samples = []
        for _ in range(reps):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                samples.append(1000 * (time.perf_counter() - t))
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device == "cuda" else None
        result = {"ms": statistics.median(samples), "samples_ms": [round(s, 4) for s in samples],
                  "warmup_s": round(first * warmup, 2), "peak_gib": None if peak is None else round(peak, 3)}
        if back_to_back and self.device == "cuda":
            n, groups = max(1, reps // 3), []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(n):
                    fn()
                end.record()
                end.synchronize()
                groups.append(start.elapsed_time(end) / n)
            result["ms_back_to_back"], result["back_to_back_ms"] = statistics.median(groups), groups
        return result

    def run(self, key: str, build, need_s: float = 5.0, **timing) -> dict | None:
        """Measure `build()` (which returns the pass) under `key`, unless fewer than `need_s` seconds are left. The
        one-layer cells (`layer/...`, `moe_layer/...`) are timed back to back too (`time_pass`)."""
        if self.left() < need_s:
            self.skipped.append(key)
            return None
        try:
            result = self.time_pass(build(), **{"back_to_back": key.startswith(("layer/", "moe_layer/")), **timing})
        except torch.cuda.OutOfMemoryError as e:
            result = {"error": f"out of memory: {str(e).splitlines()[0][:200]}"}
        except Exception as e:  # one failing configuration must not hide the others
            result = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-2000:]}
        finally:
            if self.device == "cuda":
                torch.cuda.empty_cache()
        self.results[key] = result
        print(json.dumps({key: {k: v for k, v in result.items() if k not in ("samples_ms", "back_to_back_ms",
                                                                           "traceback")}}),
              flush=True)
        return result


# ---------------------------------------------------------------------------------------------------- layers


def s4_layer(H: int, N: int, **config) -> S4Layer:
    layer = S4Layer(S4Config(d_model=H, d_state=N, **config))
    layer.kernel.reset_parameters()
    nn.init.normal_(layer.D)
    return layer


def layer_pass(bench: Bench, module: nn.Module, B: int, L: int, H: int, autocast: bool, layout: str = "blh",
               compiled: bool = False, mode: str | None = None, static_input: bool = False):
    """forward + backward of `module` on a float32 input with a random output gradient; `compiled` under
    `torch.compile(mode=mode)` (reduce-overhead: CUDA graphs, as `train.compile_mode: reduce-overhead`).
    `static_input`: the input's address marked static, so that CUDA graphs read it where it is rather than copy it
    into their own buffer on every replay (inside a model a layer's input is made in the graph: no copy either)."""
    device = bench.device
    module = module.to(device)
    shape = (B, L, H) if layout == "blh" else (B, H, L)
    x = torch.randn(*shape, device=device, requires_grad=True)
    if static_input:
        torch._dynamo.mark_static_address(x)
    forward = torch.compile(module, mode=mode) if compiled else module

    def out():
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            y = forward(x)
        return y[0] if isinstance(y, tuple) else y

    grad = torch.randn_like(out().detach())

    def run():
        for p in module.parameters():
            p.grad = None
        x.grad = None
        out().backward(grad)
    return run


def section_layer_paths(bench: Bench, s, paths):
    """The S4 layer on these paths alone, eager (a rerun at other defaults). Beside the fused path, the same layer
    with PyTorch's GLU (`layer/fused_torch_glu`): the paired baseline of the GLU kernels
    (`s4d_chunked.project_glu_channels_first`); and with the GELU in the fused kernels, each way that
    `s4d_fused.GELU_IN_KERNELS` offers (`layer/fused_gelu_forward`, `layer/fused_gelu_both`)."""
    from s4accel.models import modeling_s4, s4d_fused

    B, H, N = s["layer_batch"], s["d_model"], s["d_state"]
    for L in s["layer_lengths"]:
        for path in paths:
            bench.run(f"layer/{path}/L{L}", lambda: layer_pass(bench, s4_layer(H, N, conv_path=path), B, L, H, True))
            if path != "fused":
                continue
            kernels, modeling_s4.glu_kernels_run = modeling_s4.glu_kernels_run, lambda x: False
            try:
                bench.run(f"layer/fused_torch_glu/L{L}",
                          lambda: layer_pass(bench, s4_layer(H, N, conv_path=path), B, L, H, True))
            finally:
                modeling_s4.glu_kernels_run = kernels
            default = s4d_fused.GELU_IN_KERNELS
            for mode in s4d_fused.GELU_MODES:
                if mode == default:
                    continue
                s4d_fused.GELU_IN_KERNELS = mode
                try:
                    bench.run(f"layer/fused_gelu_{mode}/L{L}",
                              lambda: layer_pass(bench, s4_layer(H, N, conv_path=path), B, L, H, True))
                finally:
                    s4d_fused.GELU_IN_KERNELS = default


def section_layer(bench: Bench, s):
    B, H, N = s["layer_batch"], s["d_model"], s["d_state"]
    for L in s["layer_lengths"]:
        bench.run(f"layer/fused/L{L}", lambda: layer_pass(bench, s4_layer(H, N, conv_path="fused"), B, L, H, True))
        bench.run(f"layer/chunked/L{L}", lambda: layer_pass(bench, s4_layer(H, N, conv_path="chunked"), B, L, H, True))
        bench.run(f"layer/fft/L{L}", lambda: layer_pass(bench, s4_layer(H, N, conv_path="fft"), B, L, H, True))
        bench.run(f"layer/attention/L{L}", lambda: layer_pass(bench, CausalSelfAttention(H, s["heads"]), B, L, H,
                                                              True))


def section_layer_compiled(bench: Bench, s, paths=("fused", "chunked")):
    """The layer on these paths compiled; "attention": the attention layer compiled, the fair opponent of a compiled
    S4 layer."""
    B, H, N = s["layer_batch"], s["d_model"], s["d_state"]

    def module(path):
        return CausalSelfAttention(H, s["heads"]) if path == "attention" else s4_layer(H, N, conv_path=path)
    for L in s["layer_lengths"]:
        for path in paths:
            torch._dynamo.reset()
            bench.run(f"layer/{path}_compiled/L{L}",
                      lambda: layer_pass(bench, module(path), B, L, H, True, compiled=True), need_s=60)


def section_layer_graphs(bench: Bench, s):
    """The fused layer compiled in mode reduce-overhead: its forward and backward replayed as CUDA graphs, so a short
    layer no longer waits on the host's launches (what `train.compile_mode: reduce-overhead` runs); its input read in
    place (`layer_pass`'s `static_input`). Earlier runs' `layer/fused_graphs` cells copied it on every replay."""
    B, H, N = s["layer_batch"], s["d_model"], s["d_state"]
    for L in s["layer_lengths"]:
        torch._dynamo.reset()
        bench.run(f"layer/fused_graphs_static/L{L}",
                  lambda: layer_pass(bench, s4_layer(H, N, conv_path="fused"), B, L, H, True, compiled=True,
                                     mode="reduce-overhead", static_input=True), need_s=60, warmup=4)


def section_fused_sweep(bench: Bench, s):
    """The fused kernels' steps per chunk (T) and (batch rows, warps) per program of the forward and the backward,
    eager, at the middle layer length: what the defaults were chosen from (s4accel.models.modeling_s4.FUSED_CHUNK,
    s4d_fused.LAUNCH). The rest of the run takes the fastest (recorded as `fused_chosen`)."""
    from s4accel.models import modeling_s4, s4d_fused

    B, H, N = s["layer_batch"], s["d_model"], s["d_state"]
    L = s["layer_lengths"][len(s["layer_lengths"]) // 2]
    best = None
    for T, forward, backward in s["fused_configs"]:
        s4d_fused.LAUNCH = {"forward": forward, "backward": backward}
        r = bench.run(f"fused_sweep/T{T}/F{forward[0]}x{forward[1]}/B{backward[0]}x{backward[1]}/L{L}",
                      lambda: layer_pass(bench, s4_layer(H, N, conv_path="fused", conv_chunk=T), B, L, H, True),
                      seconds=0.6)
        if r and "ms" in r and (best is None or r["ms"] < best[0]):
            best = (r["ms"], T, forward, backward)
    if best is None:
        best = (None, modeling_s4.FUSED_CHUNK, *bench.fused_defaults)
    modeling_s4.FUSED_CHUNK = best[1]
    s4d_fused.LAUNCH = {"forward": best[2], "backward": best[3]}
    bench.results["fused_chosen"] = {"chunk": best[1], "forward": best[2], "backward": best[3], "at_L": L}
    print(json.dumps({"fused_chosen": bench.results["fused_chosen"]}), flush=True)


def section_short_batches(bench: Bench, s):
    """One S4 layer (fused path, eager) at the batch a language-model step of `tokens` has at each model length
    whose batch is short (fewer rows than a program takes): there the kernels' programs are as few as the channels
    and as long as the sequence, so the chain of chunks, not the memory, sets their time. Chunks of 64 steps (the
    default) beside 128 (half the chain, heavier steps), and the rows cut into segments by the kernels
    (`s4d_fused.SEGMENTS_IN_KERNELS`): to choose the chunk, and the segments, by batch."""
    from s4accel.models import s4d_fused

    H, N = s["d_model"], s["d_state"]
    for L in s["model_lengths"]:
        B = max(1, s["tokens"] // L)
        if B >= 16:
            continue
        for T, cut in ((64, False), (128, False), (64, True)):
            s4d_fused.SEGMENTS_IN_KERNELS = cut
            try:
                bench.run(f"short/T{T}{'_segments' if cut else ''}/L{L}",
                          lambda: layer_pass(bench, s4_layer(H, N, conv_path="fused", conv_chunk=T), B, L, H, True))
            finally:
                s4d_fused.SEGMENTS_IN_KERNELS = False


def section_chunks(bench: Bench, s):
    B, H, N = s["layer_batch"], s["d_model"], s["d_state"]
    for L in s["layer_lengths"]:
        for T in s["chunks"]:
            if T <= L:
                bench.run(f"chunks/bf16/T{T}/L{L}", lambda: layer_pass(
                    bench, s4_layer(H, N, conv_path="chunked", conv_chunk=T), B, L, H, True))
    for L in s["layer_lengths"][:1]:
        for T in s["chunks"]:
            if T <= L:
                bench.run(f"chunks/fp32/T{T}/L{L}", lambda: layer_pass(
                    bench, s4_layer(H, N, conv_path="chunked", conv_chunk=T), B, L, H, False))


def section_fp32(bench: Bench, s):
    B, H, N = s["layer_batch"], s["d_model"], s["d_state"]
    reference = import_reference(bench.args.reference_dir)
    for L in s["layer_lengths"][:2]:
        bench.run(f"fp32/fused/L{L}", lambda: layer_pass(bench, s4_layer(H, N, conv_path="fused"), B, L, H, False))
        bench.run(f"fp32/fused_T64/L{L}", lambda: layer_pass(bench, s4_layer(H, N, conv_path="fused", conv_chunk=64),
                                                             B, L, H, False))
        bench.run(f"fp32/chunked/L{L}", lambda: layer_pass(bench, s4_layer(H, N, conv_path="chunked"), B, L, H, False))
        bench.run(f"fp32/fft/L{L}", lambda: layer_pass(bench, s4_layer(H, N, conv_path="fft"), B, L, H, False))
        if reference is not None:
            bench.run(f"fp32/reference/L{L}", lambda: layer_pass(
                bench, reference.S4D(H, d_state=N, transposed=True), B, L, H, False, layout="bhl"))
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            bench.run(f"fp32/chunked_tf32/L{L}", lambda: layer_pass(
                bench, s4_layer(H, N, conv_path="chunked"), B, L, H, False))
            bench.run(f"fp32/fused_tf32/L{L}", lambda: layer_pass(
                bench, s4_layer(H, N, conv_path="fused"), B, L, H, False))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False


def import_reference(ref_dir):
    """state-spaces/s4's models/s4/s4d.py from `ref_dir`, or None. Its one import of the research repo (DropoutNd,
    used only with dropout > 0) gets an inert stand-in."""
    if ref_dir is None or not (Path(ref_dir) / "s4d.py").is_file():
        return None
    import importlib
    import types

    for name in ("src", "src.models", "src.models.nn"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["src.models.nn"].DropoutNd = nn.Dropout
    sys.path.insert(0, str(ref_dir))
    try:
        return importlib.import_module("s4d")
    except ImportError as e:
        print(json.dumps({"reference": f"not imported: {e}"}), flush=True)
        return None


# ---------------------------------------------------------------------------------------------------- models


def build_lm(family: str, s) -> nn.Module:
    common = dict(vocab_size=s["vocab"], d_model=s["d_model"], n_layer=s["n_layer"])
    # s4d (s4d_segments, s4d_kernel_segments: with the switch set by their section): the path `auto` takes;
    # s4d_chunked: batched matmuls
    if family in ("s4d", "s4d_chunked", "s4d_segments", "s4d_kernel_segments"):
        path = "chunked" if family == "s4d_chunked" else "auto"
        return S4ForCausalLM(S4Config(d_state=s["d_state"], ffn="mlp", d_ffn=s["d_ffn"], conv_path=path, **common))
    if family == "dense":
        return MoEForCausalLM(MoEConfig(n_head=s["heads"], d_ffn=s["d_ffn"], use_moe=False, **common))
    return MoEForCausalLM(MoEConfig(n_head=s["heads"], d_ffn=s["d_ffn"] // 2, num_experts=8, num_experts_per_tok=2,
                                    **common))


def lm_pass(bench: Bench, family: str, L: int, compiled: bool | str, s):
    """A training step; `compiled` True: as `train.compile: true` compiles it; "graphs": as `train.compile_mode:
    reduce-overhead` does, the whole model compiled and replayed as CUDA graphs."""
    device = bench.device
    torch.manual_seed(0)
    model = build_lm(family, s).to(device)
    batch = max(1, s["tokens"] // L)
    ids = torch.randint(3, s["vocab"], (batch, L), device=device)
    forward = model
    if compiled == "graphs":
        torch._dynamo.reset()
        forward = torch.compile(model, mode="reduce-overhead")
    elif compiled:
        from accelerate.utils import compile_regions

        torch._dynamo.reset()
        model = forward = compile_regions(model)
        model.loss_function = torch.compile(model.loss_function)  # as train.compile does (compiled_loss.py)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

    def run():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    run.meta = {"batch": batch, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                "flops": sum(step_flops(model.config, batch, L).values())}
    return run


def section_segments(bench: Bench, s):
    """The S4D model compiled with the rows of short batches cut into segments (`s4d_segments.UNDER_COMPILE`, off by
    default; and by the kernels themselves, `s4d_fused.SEGMENTS_IN_KERNELS`, off too) and as by default (rows read
    whole), side by side at the lengths whose batches are short."""
    from s4accel.models import s4d_fused, s4d_segments

    short = [L for L in s["model_lengths"] if s["tokens"] // L < 16]
    for L in short:
        section_models(bench, s, [("s4d", L, True)])
        s4d_segments.UNDER_COMPILE = True
        try:
            section_models(bench, s, [("s4d_segments", L, True)])
        finally:
            s4d_segments.UNDER_COMPILE = False
        s4d_fused.SEGMENTS_IN_KERNELS = True
        try:
            section_models(bench, s, [("s4d_kernel_segments", L, True)])
        finally:
            s4d_fused.SEGMENTS_IN_KERNELS = False


def section_models(bench: Bench, s, plan):
    peak = peak_tflops(torch.device(bench.device), "bf16")[0] if bench.device == "cuda" else None
    for family, L, compiled in plan:
        key = f"models/{family}/{MODES[compiled]}/L{L}"
        if key in bench.results:
            continue
        holder = {}

        def build():
            holder["run"] = lm_pass(bench, family, L, compiled, s)
            return holder["run"]
        need_s, warmup = {False: (15, 2), True: (90, 3), "graphs": (150, 4)}[compiled]  # graphs: capture, then replay
        result = bench.run(key, build, need_s=need_s, warmup=warmup, seconds=2.0, most=10)
        if result and "ms" in result:
            meta = holder["run"].meta
            result.update(meta)
            result["tokens_per_s"] = round(meta["batch"] * L / (result["ms"] / 1000))
            tflops = meta["flops"] / (result["ms"] / 1000) / 1e12
            result["tflops"] = round(tflops, 1)
            result["mfu"] = round(tflops / peak, 4) if peak else None


MODES = {False: "eager", True: "compiled", "graphs": "graphs"}
"""How a language-model cell ran, by lm_pass's `compiled`: its key's mode and its table row."""


ISSUE_LENGTHS = (2048, 8192)
"""The language-model lengths the speed issue sets its targets at: measured first."""


def first_lengths(s) -> list:
    """The model lengths, the issue's two first."""
    first = [L for L in ISSUE_LENGTHS if L in s["model_lengths"]]
    return first + [L for L in s["model_lengths"] if L not in first]


def model_plan(s) -> list:
    """Eager first (every family, the issue's lengths first), then the compiled runs the comparison needs, then the
    rest."""
    lengths = first_lengths(s)
    first, rest = [L for L in lengths if L in ISSUE_LENGTHS], [L for L in lengths if L not in ISSUE_LENGTHS]
    eager = [(f, L, False) for L in lengths for f in ("s4d", "dense", "moe")]
    compiled = [(f, L, True) for L in first for f in ("s4d", "dense")]
    later = [(f, L, True) for L in rest for f in ("s4d", "dense")] + [("moe", L, True) for L in first + rest]
    return eager, compiled, later


# ---------------------------------------------------------------------------------------------------- MoE layer


def moe_flops(tokens: int, k: int, D: int, Fh: int) -> float:
    """The expert matmuls of a forward + backward: six per SwiGLU matrix pair, 3 D F multiply-adds per routed pair."""
    return 6 * tokens * k * 3 * D * Fh


def section_moe_layer(bench: Bench, s):
    """One MoE layer (bench/moe.py's passes) at the issue's shape, bf16 autocast: this checkout's layer, the layer of
    `--moe-baseline` (an earlier moe.py) on the same weights and input, the dense SwiGLU of width k F, the expert
    matmuls alone and the routing alone; on a GPU also the layer and the dense SwiGLU under `torch.compile`."""
    import importlib.util

    T, D, Fh = s["moe_tokens"], s["moe_d_model"], s["moe_d_ffn"]
    args = moe_args(bench, s)
    baseline = None
    if bench.args.moe_baseline:
        # named inside s4accel.models, so that its relative imports (`from .moe_kernels import ...`) are this
        # checkout's modules
        spec = importlib.util.spec_from_file_location("s4accel.models.moe_baseline", bench.args.moe_baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    for E, k in s["moe_configs"]:
        fns = moe_passes(bench, s, E, k, compiled=bench.device == "cuda")  # compiling: a GPU run only
        for name in ("moe", "moe_torch_ops", "moe_torch_router", "dense", "matmuls_only", "routing_only", "harness",
                     "moe_compiled_routing", "routing_only_compiled", "moe_compiled_experts", "moe_compiled",
                     "dense_compiled"):
            if name not in fns:
                continue
            result = bench.run(f"moe_layer/{name}/E{E}k{k}", lambda: fns[name],
                               need_s=60 if "compiled" in name else 10)  # a compile takes 15 s or more
            if result and "ms" in result and name in ("moe", "moe_torch_ops", "moe_torch_router", "matmuls_only",
                                                      "moe_compiled", "moe_compiled_routing", "moe_compiled_experts"):
                result["tflops"] = round(moe_flops(T, k, D, Fh) / (result["ms"] / 1000) / 1e12, 1)
        if baseline is not None:
            result = bench.run(f"moe_layer/baseline/E{E}k{k}", lambda: baseline_pass(bench, baseline, args, E, k),
                               need_s=10)
            if result and "ms" in result:
                result["tflops"] = round(moe_flops(T, k, D, Fh) / (result["ms"] / 1000) / 1e12, 1)
        del fns
        if bench.device == "cuda":
            torch.cuda.empty_cache()


def moe_args(bench: Bench, s):
    from types import SimpleNamespace
    return SimpleNamespace(tokens=s["moe_tokens"], d_model=s["moe_d_model"], d_ffn=s["moe_d_ffn"],
                           device=bench.device, dtype="bfloat16" if bench.device == "cuda" else "float32")


def moe_passes(bench: Bench, s, E: int, k: int, compiled: bool = False) -> dict:
    """bench/moe.py's passes (name -> a forward + backward) at this run's MoE layer shape."""
    import moe as moe_bench  # bench/moe.py
    moe_bench.SYNC_EACH_PASS = False  # CUDA events time them here
    return moe_bench.build(moe_args(bench, s), E, k, compiled=compiled)


def baseline_pass(bench: Bench, module, args, E: int, k: int):
    """forward + backward of an earlier moe.py's MoELayer, with its losses, on bench/moe.py's weights and input."""
    config = MoEConfig(d_model=args.d_model, d_ffn=args.d_ffn, num_experts=E, num_experts_per_tok=k, n_head=4)
    torch.manual_seed(0)
    layer = module.MoELayer(config, args.d_model)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.02)
    layer.to(bench.device)
    x = torch.randn(args.tokens, args.d_model, device=bench.device).requires_grad_()
    g = torch.randn(args.tokens, args.d_model, device=bench.device)

    def run():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        with torch.autocast(bench.device, dtype=torch.bfloat16, enabled=bench.device == "cuda"):
            y, aux = layer(x)
            y = y + 0 * (aux["balance_loss"] + aux["z_loss"])
        (y.float() * g).sum().backward()
    return run


# ---------------------------------------------------------------------------------------------------- small model


def small_step(bench: Bench, batch: int, length: int, mode: str | None):
    """A training step of the quick-start model (s4-small, byte vocabulary): forward, backward, fused AdamW, bf16
    autocast; `mode` None: eager, else the whole model under `torch.compile(mode=...)` (reduce-overhead: CUDA
    graphs, as `train.compile_mode: reduce-overhead`)."""
    from s4accel.config.sizes import MODEL_SIZES

    fields = {k: v for k, v in MODEL_SIZES["s4-small"].items() if k != "family"}
    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(vocab_size=259, **fields)).to(bench.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=bench.device == "cuda")
    ids = torch.randint(3, 259, (batch, length), device=bench.device)
    if mode is not None:
        torch._dynamo.reset()
    forward = model if mode is None else torch.compile(model, mode=mode)

    def run():
        with torch.autocast(bench.device, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def section_small(bench: Bench, s):
    """Eager and CUDA graphs at every shape first, then mode default (no graphs) at the first: what the graphs add."""
    plan = [(name, mode, shape) for shape in s["small_shapes"]
            for name, mode in (("eager", None), ("graphs", "reduce-overhead"))]
    plan += [("compiled", "default", s["small_shapes"][0])]
    for name, mode, (batch, length) in plan:
        bench.run(f"small/{name}/b{batch}x{length}", lambda: small_step(bench, batch, length, mode),
                  need_s=10 if mode is None else 60, warmup=2 if mode is None else 4, seconds=1.0, most=50)


# What a profiled kernel is, by its name: the summary of each profile adds their times by kind.
KERNEL_KINDS = (("s4d_fused", r"^_(forward|backward)_kernel\b"),
                ("moe_kernels", r"^_(pair_sums|swiglu_weighted|route_cast)"),
                ("attention", r"flash|fmha|attention|sdpa"),
                ("matmul", r"gemm|nvjet|cutlass|sm90_xmma|sm80_xmma|cublas|_mm_|matmul"),
                ("inductor", r"^triton_"), ("optimizer", r"adam|multi_tensor|foreach"),
                ("softmax_loss", r"softmax|nll|cross_entropy|log_sum"), ("glu", r"glu"),
                ("copy_cast", r"copy|cast|transpose|cat_|contiguous"), ("fill", r"fill|zero"),
                ("reduce", r"reduce"), ("elementwise", r"elementwise"))


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def section_profile(bench: Bench, s, compiled_only: bool = False, moe: bool = False, longest: bool = False):
    """The CUDA kernels of one pass, by total time and by kind (where the time goes, for whoever speeds it up next):
    the S4 layer (conv_path auto: the fused kernels on CUDA) at the shortest layer length, eager and compiled, and a
    compiled training step (as `train.compile` compiles it) of the S4D and of the dense language model at L 2,048.
    `compiled_only`: the compiled layer at the two shortest lengths and the S4D model. `moe`: instead, the first MoE
    layer shape of `section_moe_layer` (issue 40's E 8, k 2) eager, and the dense SwiGLU beside it. `longest`:
    instead, the S4D and dense models compiled at the longest model length (where a step's batch has the fewest
    rows: the fused kernels' programs are longest and fewest). Beside each, the pass's wall time (CUDA events,
    without the profiler): where it is well above the kernels' sum, the GPU waits for the host to launch them."""
    from torch.profiler import ProfilerActivity, profile

    B, H, N = s["layer_batch"], s["d_model"], s["d_state"]
    L = s["layer_lengths"][0]
    Lm = 2048 if 2048 in s["model_lengths"] else s["model_lengths"][0]
    targets = {f"layer_eager_L{L}": lambda: layer_pass(bench, s4_layer(H, N), B, L, H, True),
               f"layer_compiled_L{L}": lambda: layer_pass(bench, s4_layer(H, N), B, L, H, True, compiled=True),
               f"s4d_lm_compiled_L{Lm}": lambda: lm_pass(bench, "s4d", Lm, True, s),
               f"dense_lm_compiled_L{Lm}": lambda: lm_pass(bench, "dense", Lm, True, s)}
    if compiled_only:
        L2 = s["layer_lengths"][1]
        targets = {f"layer_compiled_L{L2}": lambda: layer_pass(bench, s4_layer(H, N), B, L2, H, True, compiled=True),
                   **{k: v for k, v in targets.items() if k.startswith(("layer_compiled", "s4d_lm"))}}
    if longest:
        Ll = max(s["model_lengths"])
        targets = {f"s4d_lm_compiled_L{Ll}": lambda: lm_pass(bench, "s4d", Ll, True, s),
                   f"dense_lm_compiled_L{Ll}": lambda: lm_pass(bench, "dense", Ll, True, s)}
    if moe:
        E, k = s["moe_configs"][0]
        targets = {f"moe_layer_eager_E{E}k{k}": lambda: moe_passes(bench, s, E, k)["moe"],
                   f"moe_dense_eager_E{E}k{k}": lambda: moe_passes(bench, s, E, k)["dense"]}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.device == "cuda" else [])
    out = bench.results.setdefault("profile", {})
    for name, build in targets.items():
        if bench.left() < (30 if name.startswith("layer") else 90):
            bench.skipped.append(f"profile/{name}")
            continue
        try:
            run = build()
            wall = bench.time_pass(run, warmup=3, seconds=0.5, most=10)["ms"]  # compiles, warms up, times
            with profile(activities=activities) as prof:
                run()
                bench.sync()
            attr = "device_time_total" if bench.device == "cuda" else "cpu_time_total"
            rows = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0 and
                    (bench.device != "cuda" or getattr(e, "device_type", None) is not None and
                     str(e.device_type).endswith("CUDA"))]
            rows.sort(key=lambda e: -getattr(e, attr))
            total = sum(getattr(e, attr) for e in rows)
            kinds = {}
            for e in rows:
                kind = kernel_kind(e.key)
                kinds[kind] = kinds.get(kind, 0.0) + getattr(e, attr) / 1000
            out[name] = {"total_ms": round(total / 1000, 3), "wall_ms": round(wall, 3),
                         "launches": sum(e.count for e in rows),
                         "by_kind_ms": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                         "kernels": [{"name": e.key[:120], "ms": round(getattr(e, attr) / 1000, 3), "calls": e.count,
                                      "kind": kernel_kind(e.key)} for e in rows[:40]]}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            if bench.device == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps({f"profile/{name}": out[name]}), flush=True)


def profile_lines(R: dict) -> list:
    """The profiles' time by kind of kernel, one column per profiled pass."""
    prof = {k: v for k, v in R.get("profile", {}).items() if "by_kind_ms" in v}
    if not prof:
        return []
    kinds = sorted({k for v in prof.values() for k in v["by_kind_ms"]},
                   key=lambda k: -max(v["by_kind_ms"].get(k, 0) for v in prof.values()))
    lines = ["", "## Where the time goes (CUDA kernel time of one profiled pass, ms, by kind)", "",
             "| kind | " + " | ".join(prof) + " |", "|---" * (len(prof) + 1) + "|"]
    lines += [f"| {kind} | " + " | ".join(f"{v['by_kind_ms'].get(kind, 0):.2f}" for v in prof.values()) + " |"
              for kind in kinds]
    lines.append("| **total** | " + " | ".join(f"{v['total_ms']:.2f}" for v in prof.values()) + " |")
    if all("wall_ms" in v for v in prof.values()):
        lines.append("| wall time of the pass | " + " | ".join(f"{v['wall_ms']:.2f}" for v in prof.values()) + " |")
        lines.append("| kernels launched | " + " | ".join(str(v["launches"]) for v in prof.values()) + " |")
    return lines


# ---------------------------------------------------------------------------------------------------- report


def fmt_ms(r):
    if r is None:
        return "not measured"
    if "error" in r:
        return "OOM" if "out of memory" in r["error"] else "error"
    return f"{r['ms']:.2f} ms ({r['peak_gib']:.1f} GiB)" if r.get("peak_gib") is not None else f"{r['ms']:.2f} ms"


def fmt_lm(r):
    if r is None:
        return "not measured"
    if "error" in r:
        return "OOM" if "out of memory" in r["error"] else "error"
    mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
    mem = f", {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
    return f"{r['tokens_per_s'] / 1000:.0f}k{mfu}{mem}"


def layer_tables(R: dict, s) -> list[str]:
    """The one-layer tables: the paths against attention, the chunk sweep, float32."""
    lines = []
    Ls = s["layer_lengths"]
    head = "| | " + " | ".join(f"L {L:,}" for L in Ls) + " |"
    sep = "|---" * (len(Ls) + 1) + "|"
    lines += [f"## One layer, forward + backward (B {s['layer_batch']}, H {s['d_model']}, N {s['d_state']}, "
              "bf16 autocast, float32 input)", "", "Time (peak memory of the pass, inputs included).", "", head, sep]
    rows = [("S4Layer, fused path (eager)", "layer/fused"),
            ("the same with PyTorch's GLU (eager; before the GLU kernels)", "layer/fused_torch_glu"),
            ("the same with GELU after the fused kernels (`s4d_fused.GELU_IN_KERNELS: off`)", "layer/fused_gelu_off"),
            ("the same with GELU in the fused forward kernel (`GELU_IN_KERNELS: forward`)",
             "layer/fused_gelu_forward"),
            ("the same with GELU in both fused kernels (`GELU_IN_KERNELS: both`)", "layer/fused_gelu_both"),
            ("S4Layer, fused path (`torch.compile`)", "layer/fused_compiled"),
            ("S4Layer, fused path (`torch.compile`, CUDA graphs: mode reduce-overhead)", "layer/fused_graphs"),
            ("S4Layer, fused path (CUDA graphs, the input read in place: not copied into the graph each pass)",
             "layer/fused_graphs_static"),
            ("S4Layer, chunked path (eager)", "layer/chunked"),
            ("S4Layer, chunked path (`torch.compile`)", "layer/chunked_compiled"),
            ("S4Layer, FFT path (float32 FFTs at 2L; the CPU path)", "layer/fft"),
            ("causal attention (SDPA) with qkv and output projections", "layer/attention"),
            ("the same attention layer (`torch.compile`)", "layer/attention_compiled")]
    for name, key in rows:
        lines.append(f"| {name} | " + " | ".join(fmt_ms(R.get(f"{key}/L{L}")) for L in Ls) + " |")
    for path, mode, suffix in (("fused", "eager", ""), ("chunked", "eager", ""), ("fused", "compiled", "_compiled")):
        ratios = []
        for L in Ls:
            a, c = R.get(f"layer/attention{suffix}/L{L}"), R.get(f"layer/{path}{suffix}/L{L}")
            ratios.append(f"{a['ms'] / c['ms']:.2f}x" if a and c and "ms" in a and "ms" in c else "-")
        if any(r != "-" for r in ratios):
            lines += [f"| attention / {path} ({mode}) | " + " | ".join(ratios) + " |"]
    lines += [""]

    def back_to_back(key, L):
        r = R.get(f"{key}/L{L}") or {}
        return f"{r['ms_back_to_back']:.2f} ms" if "ms_back_to_back" in r else "not measured"
    timed = [(name, key) for name, key in rows if any(back_to_back(key, L) != "not measured" for L in Ls)]
    if timed:
        lines += ["The same passes launched back to back, with no wait between them: a pass's cost where the host "
                  "runs ahead of the GPU, as between a model's layers (above, each pass starts on an idle GPU and "
                  "waits for its first launches).", "", head, sep]
        lines += [f"| {name} | " + " | ".join(back_to_back(key, L) for L in Ls) + " |" for name, key in timed]
        lines += [""]
    sweep = [k for k in R if k.startswith("fused_sweep/")]
    if sweep:
        chosen = R.get("fused_chosen", {})
        lines += ["## The fused kernels' shape (eager, L " + ", ".join(sorted({k.split('/L')[-1] for k in sweep}))
                  + ")", "", "Steps per chunk T; batch rows x warps per program of the forward and of the backward. "
                  f"The rest of the run took T {chosen.get('chunk')}, forward {chosen.get('forward')}, backward "
                  f"{chosen.get('backward')}.", "", "| T | forward | backward | ms |", "|---|---|---|---|"]
        for key in sweep:
            T, forward, backward, _ = (part[1:] for part in key.split("/")[1:])
            lines.append(f"| {T} | {forward} | {backward} | {fmt_ms(R[key])} |")
        lines.append("")
    short = sorted({int(k.split("/L")[-1]) for k in R if k.startswith("short/")})
    if short:
        lines += ["## The fused layer at a language-model step's short batches (eager)", "",
                  f"B = {s['tokens']:,} tokens / L rows, H {s['d_model']}, N {s['d_state']}, bf16 autocast, forward "
                  "+ backward: the kernels' programs are as few as the channels and their chains as long as L.", "",
                  "| | " + " | ".join(f"L {L:,} (B {max(1, s['tokens'] // L)})" for L in short) + " |",
                  "|---" * (len(short) + 1) + "|"]
        for name, key in (("chunks of 64 steps (the default)", "T64"), ("chunks of 128", "T128"),
                          ("chunks of 64, rows cut into segments by the kernels (`SEGMENTS_IN_KERNELS`)",
                           "T64_segments")):
            lines.append(f"| {name} | " + " | ".join(fmt_ms(R.get(f"short/{key}/L{L}")) for L in short) + " |")
        lines.append("")
    if any(k.startswith("chunks/") for k in R):
        lines += ["## Chunk size of the chunked path (eager)", "", head, sep]
        for dtype in ("bf16", "fp32"):
            for T in s["chunks"]:
                cells = [fmt_ms(R.get(f"chunks/{dtype}/T{T}/L{L}")) for L in Ls]
                lines.append(f"| {dtype}, chunks of {T} | " + " | ".join(cells) + " |")
        lines.append("")
    if not any(k.startswith("fp32/") for k in R):
        return lines
    lines += ["## float32, no autocast", "", "| | " + " | ".join(f"L {L:,}" for L in Ls[:2]) + " |",
              "|---" * 3 + "|"]
    for name, key in (("S4Layer, fused (float32 products, no TF32, chunks of 32)", "fp32/fused"),
                      ("S4Layer, fused (the same, chunks of 64: they spill)", "fp32/fused_T64"),
                      ("S4Layer, fused (TF32 allowed, chunks of 64)", "fp32/fused_tf32"),
                      ("S4Layer, chunked (float32 matmuls)", "fp32/chunked"),
                      ("S4Layer, chunked (TF32 allowed: `train.tf32`)", "fp32/chunked_tf32"),
                      ("S4Layer, FFT path", "fp32/fft"),
                      ("state-spaces/s4 `s4d.py` (its Conv1d in TF32, cuDNN's default)", "fp32/reference")):
        lines.append(f"| {name} | " + " | ".join(fmt_ms(R.get(f"{key}/L{L}")) for L in Ls[:2]) + " |")
    return lines


def model_table(R: dict, s) -> list[str]:
    """The language models by length, eager and compiled, and S4D against the dense model."""
    lines = []
    Ms = sorted(s["model_lengths"])
    lines += [f"## Language models, a training step of {s['tokens']:,} tokens (bf16 autocast, fused AdamW)", "",
              f"d_model {s['d_model']}, {s['n_layer']} blocks, vocabulary {s['vocab']:,}. S4D: N {s['d_state']}, "
              f"SwiGLU {s['d_ffn']} in each block. Dense: the MoE family with use_moe false, {s['heads']} heads. MoE: "
              f"8 experts of width {s['d_ffn'] // 2}, top-2. Tokens/s (MFU as s4accel.training.observe.flops counts "
              "it, peak memory). Compiled: as `train.compile: true` does at the commit that measured the cell: "
              "Accelerate's regional compilation of the blocks, and the loss compiled beside them since commits that "
              "have s4accel/training/devices/compiled_loss.py.", "",
              "| model | mode | " + " | ".join(f"L {L:,}" for L in Ms) + " |", "|---" * (len(Ms) + 2) + "|"]
    for family, name in (("s4d", "S4D"), ("s4d_segments", "S4D, short batches cut into segments"),
                         ("s4d_kernel_segments", "S4D, short batches cut into segments by the kernels"),
                         ("s4d_chunked", "S4D, chunked path"), ("dense", "dense transformer"),
                         ("moe", "MoE transformer")):
        if (family in ("s4d_chunked", "s4d_segments", "s4d_kernel_segments")
                and not any(k.startswith(f"models/{family}/") for k in R)):
            continue
        for mode in MODES.values():
            if mode == "graphs" and not any(k.startswith(f"models/{family}/graphs/") for k in R):
                continue
            cells = [fmt_lm(R.get(f"models/{family}/{mode}/L{L}")) for L in Ms]
            params = next((R[k]["params_m"] for k in R if k.startswith(f"models/{family}/") and "params_m" in R[k]),
                          None)
            label = f"{name} ({params}M)" if params else name
            lines.append(f"| {label} | {mode} | " + " | ".join(cells) + " |")
    lines += ["", "S4D against the dense transformer, each in its best mode (tokens/s ratio):", ""]
    for L in Ms:
        best = {}
        for family in ("s4d", "dense"):
            rates = [R[k]["tokens_per_s"] for k in (f"models/{family}/{mode}/L{L}" for mode in MODES.values())
                     if k in R and "tokens_per_s" in R[k]]
            best[family] = max(rates) if rates else None
        if best["s4d"] and best["dense"]:
            lines.append(f"- L {L:,}: {best['s4d'] / best['dense']:.2f}x")
    return lines


def markdown(report: dict, s) -> str:
    R = report["results"]
    lines = [f"# GPU speed: {report['device']}, {report['date']}", "",
             f"Commit `{report['commit']}`; torch {report['torch']} (CUDA {report['cuda']}, cuDNN {report['cudnn']}), "
             f"transformers {report['transformers']}, accelerate {report['accelerate']}, triton "
             f"{report['triton']}, Python {report['python']}.", "",
             f"Command: `{report['command']}`. Medians of CUDA-event timings after warm-up passes; every sample is in "
             "the JSON file of the same name.", ""]
    if report.get("note"):
        lines += [report["note"], ""]
    if report.get("runs"):  # merged from several calls (a GPU lease is short): which cells each one measured
        lines += ["Merged from these runs on the same machine type, each later one replacing the cells it measured:",
                  ""]
        lines += [f"{i}. commit `{run['commit']}`: `{run['command']}` ({len(run['keys'])} cells)"
                  for i, run in enumerate(report["runs"], 1)]
        lines.append("")
    if any(k.startswith(("layer/", "chunks/", "fp32/", "fused_sweep/", "short/")) for k in R):
        lines += layer_tables(R, s)
    if any(k.startswith("models/") for k in R):
        lines += model_table(R, s)
    lines += profile_lines(R)
    moe_keys = [k for k in R if k.startswith("moe_layer/")]
    if moe_keys:
        lines += ["", f"## One MoE layer, forward + backward ({s['moe_tokens']:,} tokens, d_model {s['moe_d_model']}, "
                  f"experts {s['moe_d_ffn']} wide, bf16 autocast, router losses included)", "",
                  "ms (TFLOP/s of the expert matmuls). Baseline: the layer of the commit named in the command "
                  "(`--moe-baseline`), on the same weights and input. PyTorch's operators: the layer with its k-way "
                  "sums, weighted SwiGLU and router in PyTorch's operators "
                  "(`moe_kernels.MOE_KERNELS = \"never\"`), where the other cells take the Triton kernels. "
                  "PyTorch's router: the layer with its other kernels, the router and the experts' cast in PyTorch's "
                  "operators (`moe_kernels.ROUTER_MAX_EXPERTS = 0`).", "",
                  "| E, k | MoE layer | PyTorch's operators | PyTorch's router | baseline layer | "
                  "dense SwiGLU of k x F | MoE / dense | expert matmuls alone | routing alone |", "|---" * 9 + "|"]
        for E, k in s["moe_configs"]:
            cell = {n: R.get(f"moe_layer/{n}/E{E}k{k}") for n in ("moe", "moe_torch_ops", "moe_torch_router",
                                                                   "baseline", "dense", "matmuls_only",
                                                                   "routing_only")}

            def ms(r):
                if r is None or "ms" not in r:
                    return fmt_ms(r)
                return f"{r['ms']:.2f}" + (f" ({r['tflops']:.0f})" if r.get("tflops") else "")
            ratio = (f"{cell['moe']['ms'] / cell['dense']['ms']:.2f}" if all(
                cell[n] and "ms" in cell[n] for n in ("moe", "dense")) else "-")
            lines.append(f"| {E}, {k} | {ms(cell['moe'])} | {ms(cell['moe_torch_ops'])} | "
                         f"{ms(cell['moe_torch_router'])} | {ms(cell['baseline'])} | {ms(cell['dense'])} | {ratio} | "
                         f"{ms(cell['matmuls_only'])} | {ms(cell['routing_only'])} |")
        if any("ms_back_to_back" in R[k] for k in moe_keys):
            names = ("moe", "moe_torch_ops", "moe_torch_router", "moe_compiled_routing", "moe_compiled_experts",
                     "dense")
            lines += ["", "The same passes launched back to back, with no wait between them (a layer's cost where the "
                      "host runs ahead of the GPU, as between a model's layers): ms a pass, and each MoE layer's over "
                      "the dense SwiGLU's.", "",
                      "| E, k | MoE layer | PyTorch's operators | PyTorch's router | routing compiled | "
                      "routing and experts compiled | dense SwiGLU |", "|---" * 7 + "|"]
            for E, k in s["moe_configs"]:
                b2b = {n: (R.get(f"moe_layer/{n}/E{E}k{k}") or {}).get("ms_back_to_back") for n in names}
                dense_ms = b2b["dense"]
                cells = [("-" if b2b[n] is None else f"{b2b[n]:.2f}" + (f" ({b2b[n] / dense_ms:.2f}x)" if dense_ms
                                                                         else "")) for n in names[:-1]]
                dense_cell = "-" if dense_ms is None else f"{dense_ms:.2f}"
                lines.append(f"| {E}, {k} | " + " | ".join(cells) + f" | {dense_cell} |")
        if any(("_compiled_routing/" in k or "_compiled_experts/" in k) for k in moe_keys):
            lines += ["", "With the routing compiled (`moe.COMPILE_ROUTING`: softmax, top-k, the row layout and the "
                      "losses as one compiled graph), the rest of the layer eager; then with the routing and the "
                      "experts compiled together (`moe.COMPILE_EXPERTS`: also the gathers, grouped matmuls and k-way "
                      "sums), the router's matmul eager: ms (TFLOP/s of the expert matmuls).", "",
                      "| E, k | MoE layer, routing compiled | MoE / dense | routing alone, compiled | "
                      "MoE layer, routing and experts compiled | MoE / dense |", "|---" * 6 + "|"]
            for E, k in s["moe_configs"]:
                m, d, r, x = (R.get(f"moe_layer/{n}/E{E}k{k}") for n in ("moe_compiled_routing", "dense",
                                                                         "routing_only_compiled",
                                                                         "moe_compiled_experts"))
                ratio, ratio_x = (f"{a['ms'] / d['ms']:.2f}" if a and d and "ms" in a and "ms" in d else "-"
                                  for a in (m, x))
                lines.append(f"| {E}, {k} | {ms(m)} | {ratio} | {ms(r)} | {ms(x)} | {ratio_x} |")
        if any(key.split("/")[1] in ("moe_compiled", "dense_compiled") for key in moe_keys):
            lines += ["", "Under `torch.compile` (the layer's forward with its losses, and the dense SwiGLU; as "
                      "`train.compile` runs them inside a block): ms (TFLOP/s of the expert matmuls).", "",
                      "| E, k | MoE layer, compiled | dense SwiGLU, compiled | MoE / dense |", "|---|---|---|---|"]
            for E, k in s["moe_configs"]:
                m, d = (R.get(f"moe_layer/{n}_compiled/E{E}k{k}") for n in ("moe", "dense"))
                ratio = f"{m['ms'] / d['ms']:.2f}" if m and d and "ms" in m and "ms" in d else "-"
                lines.append(f"| {E}, {k} | {ms(m)} | {ms(d)} | {ratio} |")
    small_keys = [k for k in R if k.startswith("small/")]
    if small_keys:
        lines += ["", "## The quick-start model (s4-small), a training step (bf16 autocast, fused AdamW)", "",
                  "ms a step: eager; the whole model under `torch.compile` (mode default); and with CUDA graphs "
                  "(mode reduce-overhead, as `train.compile_mode: reduce-overhead`).", "",
                  "| batch x length | eager | compiled | CUDA graphs | eager / CUDA graphs |", "|---" * 5 + "|"]
        for batch, length in s["small_shapes"]:
            cell = {n: R.get(f"small/{n}/b{batch}x{length}") for n in ("eager", "compiled", "graphs")}
            ratio = (f"{cell['eager']['ms'] / cell['graphs']['ms']:.2f}x" if all(
                cell[n] and "ms" in cell[n] for n in ("eager", "graphs")) else "-")
            lines.append(f"| {batch} x {length} | {fmt_ms(cell['eager'])} | {fmt_ms(cell['compiled'])} | "
                         f"{fmt_ms(cell['graphs'])} | {ratio} |")
    errors = {k: v["error"] for k, v in R.items() if "error" in v and k != "profile"}
    if errors:
        lines += ["", "## Errors", ""] + [f"- `{k}`: {v}" for k, v in errors.items()]
    if report.get("kernel_trials_failed"):
        lines += ["", "## Kernels that failed their trial on this GPU (PyTorch's operators ran instead)", ""] + [
            f"- {what}: {why}" for what, why in report["kernel_trials_failed"].items()]
    if report["skipped"]:
        lines += ["", "Not measured within the time budget: " + ", ".join(f"`{k}`" for k in report["skipped"]) + "."]
    return "\n".join(lines) + "\n"


def report_stem(report: dict) -> str:
    """`<date>-gpu-speed-<device>`: the file name of a report (its .md and .json)."""
    return f"{report['date']}-gpu-speed-" + report["device"].replace(" ", "-").replace("/", "-")


def portable_command(argv: list[str]) -> str:
    """The command as anyone can rerun it: the folder arguments inside this checkout relative to it, others named
    by what they are (a GPU machine's output folder says nothing to a reader)."""
    out, previous = [], None
    for arg in argv:
        if previous == "--reference-dir":  # a copy of state-spaces/s4's file, outside the repository
            arg = "REFERENCE-DIR"
        elif previous == "--moe-baseline":  # an earlier commit's moe.py (git show COMMIT:s4accel/models/moe.py)
            arg = Path(arg).name
        elif previous == "--out-dir" and Path(arg).is_absolute():
            path = Path(arg).resolve()
            arg = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else "OUT-DIR"
        out.append(arg)
        previous = arg
    return "python bench/gpu_speed.py " + " ".join(out)


def merge(paths: list[Path]) -> dict:
    """One report from several runs' JSON files, in order: a later run's cells replace an earlier one's; `runs`
    says which commit and command measured which cells, and each cell carries its commit."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = {**reports[-1], "results": {}, "skipped": [], "runs": []}
    for report in reports:  # (an input that is itself a merge keeps each cell's commit and its list of runs)
        cells = {k: {"commit": report["commit"], **v} for k, v in report["results"].items() if k != "profile"}
        merged["results"].update(cells)
        if "profile" in report["results"]:  # each profiled pass from the last run that profiled it
            merged["results"]["profile"] = {**merged["results"].get("profile", {}), **report["results"]["profile"]}
        merged["runs"] += report.get("runs") or [{"commit": report["commit"], "command": report["command"],
                                                  "keys": sorted(cells)}]
    measured = set(merged["results"]) | {f"profile/{k}" for k in merged["results"].get("profile", {})}
    merged["skipped"] = sorted({k for r in reports for k in r["skipped"]} - measured)
    merged["commit"] = ", ".join(dict.fromkeys(run["commit"] for run in merged["runs"]))
    merged["command"] = "python bench/gpu_speed.py --merge " + " ".join(Path(p).name for p in paths)
    merged["shapes"] = {**reports[0]["shapes"], "model_lengths": sorted(
        {L for r in reports for L in r["shapes"]["model_lengths"]}), "layer_lengths": reports[0]["shapes"][
        "layer_lengths"]}
    return merged


def shapes(args) -> dict:
    if args.quick:
        return dict(layer_batch=2, d_model=4, d_state=32, heads=2, layer_lengths=(128, 256), chunks=(32, 64),
                    fused_configs=((16, (16, 4), (16, 8)), (32, (32, 4), (16, 8))),
                    vocab=300, n_layer=2, d_ffn=128, tokens=512, model_lengths=(64, 128), moe_tokens=256,
                    moe_d_model=64, moe_d_ffn=32, moe_configs=((8, 2),), small_shapes=((2, 64),))
    return dict(layer_batch=64, d_model=768, d_state=64, heads=12, layer_lengths=LAYER_LENGTHS, chunks=CHUNKS,
                fused_configs=FUSED_CONFIGS,
                vocab=32000, n_layer=12, d_ffn=2048, tokens=TOKENS, model_lengths=MODEL_LENGTHS,
                moe_tokens=32768, moe_d_model=2048, moe_d_ffn=768, moe_configs=((8, 2), (128, 8)),
                small_shapes=((16, 256), (64, 256), (256, 256)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting measurements after this long")
    ap.add_argument("--commit", default="unknown", help="the commit measured (the GPU machine has no .git)")
    ap.add_argument("--reference-dir", type=Path, help="a folder holding state-spaces/s4's models/s4/s4d.py")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (with --device cpu)")
    ap.add_argument("--sections", nargs="+", default=["layer", "models", "layer_compiled", "fp32", "chunks", "profile",
                                                       "models_later"],
                    choices=["profile", "layer", "models", "chunks", "layer_compiled", "fp32", "models_later",
                             "models_first", "s4d_compiled", "moe_layer", "small", "moe_models", "fused_sweep",
                             "s4d_vs_dense", "s4d_paths", "layer_fused", "s4d_models", "models_graphs",
                             "layer_graphs", "profile_compiled", "segments", "attention_compiled", "profile_moe",
                             "profile_longest", "short_batches", "fused_eager"])
    ap.add_argument("--moe-baseline", type=Path,
                    help="an earlier s4accel/models/moe.py: its layer timed beside (its relative imports: this "
                    "checkout's)")
    ap.add_argument("--model-lengths", type=int, nargs="+", help="only these language-model lengths")
    ap.add_argument("--merge", type=Path, nargs="+", help="JSON reports of earlier runs to merge into one file")
    ap.add_argument("--note", help="with --merge: a paragraph the merged file carries (what a reader must know)")
    args = ap.parse_args(argv)
    if args.merge:
        report = merge(args.merge)
        report["note"] = args.note
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem = args.out_dir / report_stem(report)
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
        stem.with_suffix(".md").write_text(markdown(report, report["shapes"]))
        print(stem.with_suffix(".md").read_text())
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    import accelerate
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = False  # every length its own static graph, as a run has
    s = shapes(args)
    bench = Bench(args)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
              "date": datetime.date.today().isoformat(), "commit": args.commit, "torch": torch.__version__,
              "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
              "transformers": transformers.__version__, "accelerate": accelerate.__version__,
              "triton": triton_version, "python": platform.python_version(),
              "command": portable_command(argv if argv is not None else sys.argv[1:]),
              "shapes": s, "results": bench.results, "skipped": bench.skipped}
    print(json.dumps({k: v for k, v in report.items() if k not in ("results", "skipped")}), flush=True)
    if args.model_lengths:
        s["model_lengths"] = tuple(args.model_lengths)
    eager, compiled, later = model_plan(s)
    sections = {"profile": lambda: section_profile(bench, s), "layer": lambda: section_layer(bench, s),
                "models": lambda: section_models(bench, s, eager + compiled),
                "chunks": lambda: section_chunks(bench, s), "layer_compiled": lambda: section_layer_compiled(bench, s),
                "fp32": lambda: section_fp32(bench, s), "models_later": lambda: section_models(bench, s, later),
                "s4d_compiled": lambda: section_models(bench, s, [("s4d", L, True) for L in s["model_lengths"]]),
                "moe_layer": lambda: section_moe_layer(bench, s), "small": lambda: section_small(bench, s),
                "fused_sweep": lambda: section_fused_sweep(bench, s),
                "layer_fused": lambda: (section_layer_paths(bench, s, ("fused",)),
                                        section_layer_compiled(bench, s, ("fused",))),
                "fused_eager": lambda: section_layer_paths(bench, s, ("fused",)),
                "s4d_models": lambda: section_models(bench, s, [("s4d", L, c) for c in (False, True)
                                                                for L in s["model_lengths"]]),
                # the issue's comparison at its lengths in the models' best mode: S4D (auto path) and dense, compiled
                # (their eager rows: `models`)
                "s4d_vs_dense": lambda: section_models(bench, s, [
                    (f, L, True) for L in first_lengths(s) for f in ("s4d", "dense")]),
                # the same whole-model compiled and replayed as CUDA graphs (`train.compile_mode: reduce-overhead`)
                "models_graphs": lambda: section_models(bench, s, [
                    (f, L, "graphs") for L in first_lengths(s) for f in ("s4d", "dense")]),
                "layer_graphs": lambda: section_layer_graphs(bench, s),
                "segments": lambda: section_segments(bench, s),
                "attention_compiled": lambda: section_layer_compiled(bench, s, ("attention",)),
                "profile_compiled": lambda: section_profile(bench, s, compiled_only=True),
                "profile_moe": lambda: section_profile(bench, s, moe=True),
                "profile_longest": lambda: section_profile(bench, s, longest=True),
                "short_batches": lambda: section_short_batches(bench, s),
                "s4d_paths": lambda: section_models(bench, s, [
                    ("s4d_chunked", L, c) for c in (True, False) for L in s["model_lengths"]]),
                "moe_models": lambda: section_models(bench, s, [(f, L, False) for L in s["model_lengths"]
                                                                for f in ("moe", "dense")] +
                                                     [("moe", L, True) for L in s["model_lengths"]]),
                "models_first": lambda: section_models(bench, s, [(f, L, False) for L in s["model_lengths"]
                                                                  for f in ("s4d", "dense")] +
                                                       [(f, s["model_lengths"][0], True) for f in ("s4d", "dense")])}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / report_stem(report)
    for name in args.sections:
        try:
            sections[name]()
        except Exception as e:  # a section's own bug must not lose the others' numbers
            bench.results[f"section/{name}"] = {"error": f"{type(e).__name__}: {e}"[:500],
                                                "traceback": traceback.format_exc()[-2000:]}
            print(json.dumps({f"section/{name}": bench.results[f"section/{name}"]}), flush=True)
        report["kernel_trials_failed"] = trial_failures()  # (their cells timed PyTorch's operators instead)
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
        stem.with_suffix(".md").write_text(markdown(report, s))
    print(markdown(report, s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
