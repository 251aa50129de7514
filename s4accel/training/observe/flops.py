"""Floating-point operations of a training step, counted from the model's config, and the peak they are measured
against: what `train/tflops` and `train/mfu` report.

A transformer's `6 N` per token (N parameters) is wrong for both families here: an S4 layer's convolution is an FFT
whose cost grows with `L log L` and has no parameters, its kernel is generated once per forward whatever the batch,
and a mixture of experts runs only `k` of its `E` experts per token. So each part is counted from its shapes
(`B` rows of `L` tokens, width `H`, state `N`, vocabulary `V`):

    matmul (M x K) @ (K x N)             2 M K N; a complex one 8 M K N (4 real multiplies, 4 adds per term)
    real FFT of length n (rfft, irfft)   2.5 n log2 n per transformed row (a complex one: 5 n log2 n)
    spectral product, complex            6 per element
    training step                        forward + backward: the backward of a matmul is two (the input's and the
                                         weight's gradients); of fused attention 5 matmuls against the forward's 2
                                         (it recomputes the scores); of the FFT convolution as many transforms as
                                         the forward and twice its products (s4accel's hand-written adjoint)

Per block: S4's output projection (H -> 2H), its FFT convolution at length 2L, its kernel (S4D: a Vandermonde
product of `c H (N/2)` modes by L taps; DPLR: four Cauchy products over `Lk/2 + 1` frequencies and an inverse FFT,
and for blocks longer than `l_max` the powers of the dense `(H, N, N)` state matrix that rescale C~);
the MoE transformer's q/k/v/o projections and attention (`4 B L^2 H` forward: a block read as one text, which
overcounts the work of documents packed apart); a SwiGLU MLP (6 H F per token) or the experts (`k` active ones per
token, each 6 H F, and the router 2 H E); then the head (2 H V per token). Not counted: elementwise work
(activations, norms, residuals, the Cauchy matrices' divisions, exponentials), which FLOP conventions leave out and
`torch.utils.flop_counter.FlopCounterMode` too (tests/test_flops.py checks the counts against it, per family).
"""

from __future__ import annotations

import math
import time

import torch

# Dense (non-sparse) peak TFLOP/s by GPU, as their makers publish them: (bf16/fp16 tensor cores, float32, TF32).
GPU_PEAK_TFLOPS = {
    "H200": (989.0, 67.0, 494.0), "H100": (989.0, 67.0, 494.0), "A100": (312.0, 19.5, 156.0),
    "L40S": (362.0, 91.6, 183.0), "L4": (121.0, 30.3, 60.0), "A10": (125.0, 31.2, 62.5),
    "RTX 4090": (165.2, 82.6, 82.6), "V100": (125.0, 15.7, 15.7),
}


def matmul(m: float, k: float, n: float) -> float:
    return 2.0 * m * k * n


def rfft(rows: float, n: int) -> float:
    return rows * 2.5 * n * math.log2(n)


def s4_kernel_flops(config, L: int) -> float:
    """Forward FLOPs of one S4 layer's kernel `K (c, H, L)`, generated once per forward."""
    H, n, c = config.d_model, config.d_state // 2, 2 if config.bidirectional else 1
    if config.kernel == "s4d":  # (c, H, J, n) @ (H, n, I), complex, I J >= L
        I = 1 << max(0, math.ceil(math.log2(L) / 2))
        J = -(-L // I)
        return 4 * matmul(c * H * J, n, I)
    Lk = config.l_max
    while Lk < L:
        Lk *= 2
    F = Lk // 2 + 1  # 2c + 2 Cauchy products (k00, k01: c rows; k10, k11: one), each two complex einsums (the
    # modes and their conjugates) of n modes by F frequencies per channel
    flops = (2 * c + 2) * 2 * 4 * matmul(H, n, F) + rfft(c * H, Lk)
    if Lk > config.l_max:  # a kernel longer than l_max: C~ rescaled through dA^l_max and dA^Lk, (H, N, N) powers
        def squarings(p: int) -> int:  # binary exponentiation
            return p.bit_length() - 1 + bin(p).count("1") - 1
        N = config.d_state
        flops += (squarings(config.l_max) + squarings(Lk)) * 4 * matmul(H * N, N, N)
    return flops


def forward_flops(config, batch: int, seq_len: int, classifier: bool = False) -> dict[str, float]:
    """Forward FLOPs of the model `config` describes (a language model, or with `classifier` a sequence classifier,
    whose head reads one pooled vector per row) on `batch` rows of `seq_len` tokens, by part."""
    T, L, H = batch * seq_len, seq_len, config.d_model
    family = config.model_type
    parts: dict[str, float] = {}
    parts["head"] = matmul(batch, H, config.num_labels) if classifier else matmul(T, H, config.vocab_size)
    if getattr(config, "d_input", None):
        parts["input"] = matmul(T, config.d_input, H)
    n_layer = config.n_layer
    if family == "s4accel-s4":
        n = 2 * L  # zero-padded to a linear convolution
        parts["projections"] = n_layer * matmul(T, H, 2 * H)
        parts["fft_conv"] = n_layer * (2 * rfft(batch * H, n) + rfft(H, n))
        parts["spectral_products"] = n_layer * 6 * batch * H * (n // 2 + 1)
        parts["kernel"] = n_layer * s4_kernel_flops(config, L)
        kinds = [config.ffn] * n_layer
    else:
        parts["projections"] = n_layer * (matmul(T, H, 3 * H) + matmul(T, H, H))
        parts["attention"] = n_layer * 2 * matmul(batch * L, H, L)  # scores and values
        kinds = ["moe" if config.is_moe_layer(i) else "mlp" for i in range(n_layer)]
    k, E, F = getattr(config, "num_experts_per_tok", 0), getattr(config, "num_experts", 0), config.d_ffn
    per_kind = {"none": 0.0, "mlp": 3 * matmul(T, H, F),
                "moe": matmul(T, H, E) + 3 * matmul(T * k, H, F) + 3 * matmul(T, H, config.num_shared_experts * F)}
    if any(kind != "none" for kind in kinds):
        parts["ffn"] = sum(per_kind[kind] for kind in kinds)
    return parts


def step_flops(config, batch: int, seq_len: int, classifier: bool = False) -> dict[str, float]:
    """FLOPs of one training step (forward and backward) on `batch` rows of `seq_len` tokens, by part."""
    parts = forward_flops(config, batch, seq_len, classifier)
    out = {part: 3 * f for part, f in parts.items()}  # a matmul's backward: two matmuls of its size
    if "attention" in parts:  # a fused attention kernel's backward recomputes the scores: 5 matmuls against 2
        out["attention"] = 3.5 * parts["attention"]
    if "fft_conv" in parts:  # the adjoint transforms the gradient and back (2 of the batch's rows, 1 of the
        # kernel's) and takes two spectral products: as many transforms as the forward, twice its products
        out["fft_conv"] = 2 * parts["fft_conv"]
    return out


def flops_per_token(model, batch: int, seq_len: int) -> float | None:
    """A training step's FLOPs per token for `batch` rows of `seq_len` tokens (per process), for a model of
    s4accel's own families (None for another model: nothing is reported then)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", "") not in ("s4accel-s4", "s4accel-moe"):
        return None
    classifier = not hasattr(model, "lm_head")
    return sum(step_flops(config, batch, seq_len, classifier).values()) / (batch * seq_len)


def peak_tflops(device: torch.device, precision: str, tf32: bool = False, measure_seconds: float = 0.15) -> tuple:
    """(peak TFLOP/s of one device, where it came from): a GPU's published dense peak for the run's precision, or on
    a CPU a float32 matmul measured now (what this CPU's cores do at best, as this process gets them)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, fp32, tensor_fp32) in GPU_PEAK_TFLOPS.items():
            if key in name:
                peak = half if precision in ("bf16", "fp16") else tensor_fp32 if tf32 else fp32
                return peak, f"{key} {'bf16' if precision in ('bf16', 'fp16') else 'tf32' if tf32 else 'fp32'}"
        return None, f"unknown GPU {name!r}: set train.peak_tflops"
    if device.type != "cpu":
        return None, f"no peak known for {device.type}: set train.peak_tflops"
    return measured_cpu_peak(measure_seconds), "measured float32 matmul"


def measured_cpu_peak(seconds: float = 0.15, size: int = 512) -> float:
    """TFLOP/s of a float32 `size`-square matmul on this process's threads, the best of a few timed products."""
    # A generator of its own: this runs after a resumed run has restored its random streams (dropout, data order),
    # and drawing from them would make its steps differ from an uninterrupted run's.
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return matmul(size, size, size) / best / 1e12
