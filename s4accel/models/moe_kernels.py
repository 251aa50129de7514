"""Triton kernels for the eager `grouped_mm` MoE dispatch on CUDA (moe.py): the k-way sums of gathered rows, and
the SwiGLU activation scaled by each row's routing weight, one kernel each way.

Hand-written because eager PyTorch spreads each over several generic kernels. Profiled on an H200 (one E 8, k 2
layer, 32,768 tokens, d_model 2,048, experts 768 wide, bf16; bench/results/2026-11-28-gpu-speed-NVIDIA-H200-e1664d1):
the k-way sums gather the pairs' rows into a `(k T, D)` tensor and reduce it over k (four gathers, 0.71 ms, and two
reductions over the outer dimension, 0.55 ms), and `silu(gate) * up * w` with its backward is about ten elementwise,
copy and cat kernels (about 1.2 ms) over `(R, 2F)` tensors, each a pass over memory: together about a third of the
layer's 7.3 ms of kernels. Here each sum reads every gathered row once and writes each token's row once, and the
activation reads the gate and up halves once each way. Both compute in float32 and round once to the output's dtype
(PyTorch rounds `silu(gate)`, the product and the weight each to bf16).

Inside `torch.compile` inductor fuses these operations itself, so compiled layers keep PyTorch's operators;
Triton's interpreter (`TRITON_INTERPRET=1`) runs the kernels on CPU tensors for the tests.

Notation as in moe.py: `T` tokens of width `D`, `k` pairs a token, `R` rows of the static layout, `F` experts'
hidden width; `h (R, 2F)` is the first grouped matmul's output, `(gate | up)`.
"""

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: PyTorch's operators
    triton = None

# Where the eager `grouped_mm` layer runs these kernels: "cuda" (CUDA tensors, Triton installed, outside
# torch.compile), "always" (CPU tensors too: Triton's interpreter, for the tests), "never" (PyTorch's operators).
MOE_KERNELS = "cuda"

if triton is not None:
    @triton.jit
    def _pair_sums_kernel(src, rows, out, T, D, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[t, :] = sum_j src[rows[j T + t], :] over j < K, in order, in float32; src (R, D), rows (K T,)."""
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_t = t < T
        mask = in_t[:, None] & (d[None, :] < D)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for j in range(K):
            r = tl.load(rows + j * T + t, mask=in_t, other=0).to(tl.int64)
            acc += tl.load(src + r[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out + t[:, None] * D + d[None, :], acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_weighted_forward_kernel(h, w, act, R, Fh, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        """act[r, f] = silu(gate) up w[r] for gate = h[r, f], up = h[r, Fh + f]; h (R, 2Fh), w (R,) float32."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        f = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
        in_r = r < R
        mask = in_r[:, None] & (f[None, :] < Fh)
        at = r[:, None] * 2 * Fh + f[None, :]
        gate = tl.load(h + at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h + at + Fh, mask=mask, other=0.0).to(tl.float32)
        weight = tl.load(w + r, mask=in_r, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up * weight[:, None]
        tl.store(act + r[:, None] * Fh + f[None, :], y.to(act.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_weighted_backward_kernel(g, h, w, dh, dw_out, R, Fh, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        """From g = d act (R, Fh): dh = (g w up silu'(gate), g w silu(gate)) (R, 2Fh) and dw[r] = sum_f g silu(gate)
        up (float32); each program walks all Fh columns of its rows, so dw is one sum per row, no partials."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_r = r < R
        weight = tl.load(w + r, mask=in_r, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_R,), dtype=tl.float32)  # stored in dw_out (R,) float32
        for start in range(0, Fh, BLOCK_F):
            f = start + tl.arange(0, BLOCK_F)
            mask = in_r[:, None] & (f[None, :] < Fh)
            at = r[:, None] * 2 * Fh + f[None, :]
            gate = tl.load(h + at, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h + at + Fh, mask=mask, other=0.0).to(tl.float32)
            go = tl.load(g + r[:, None] * Fh + f[None, :], mask=mask, other=0.0).to(tl.float32)
            s = 1.0 / (1.0 + tl.exp(-gate))
            silu = gate * s
            dw += tl.sum(go * silu * up, axis=1)  # masked entries are zeros: they add nothing
            gw = go * weight[:, None]
            tl.store(dh + at, (gw * up * s * (1.0 + gate * (1.0 - s))).to(dh.dtype.element_ty), mask=mask)
            tl.store(dh + at + Fh, (gw * silu).to(dh.dtype.element_ty), mask=mask)
        tl.store(dw_out + r, dw, mask=in_r)


# (rows, columns, warps) a program, 16 values a thread. Built for sm_90 (tests/models/test_moe_kernels.py), none
# spills; the activation's backward keeps five values an element live (and a 64-bit address for each of its five
# tensors), so it takes 8 rows where the forward takes 16: 152 and 72 registers a thread in bfloat16. Untuned: the
# GPU timing (bench/gpu_speed.py, `moe_layer`) compares the layer with PyTorch's operators.
PAIR_SUMS_BLOCK = (8, 256, 4)
SWIGLU_BLOCK = {"forward": (16, 128, 4), "backward": (8, 256, 4)}  # the backward walks every column of its rows


def moe_kernels_run(x: torch.Tensor) -> bool:
    """Whether the eager layer takes these kernels for `x`: as `MOE_KERNELS` says, with Triton installed, outside
    `torch.compile`, below float64 (they compute in float32; float64 is for reference checks)."""
    if triton is None or torch.compiler.is_compiling() or x.dtype == torch.float64:
        return False
    return MOE_KERNELS == "always" or MOE_KERNELS == "cuda" and x.is_cuda


def _moe_device(x: torch.Tensor):
    """Triton launches on x's CUDA device (nothing to set for the interpreter's CPU tensors). s4d_chunked's
    `_on_device` does the same; importing it would fold that module into every saved MoE model's code file."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def pair_sums(src: torch.Tensor, rows: torch.Tensor, T: int) -> torch.Tensor:
    """`src (R, D)`, `rows (k T,)` slot-major -> `(T, D)`: each token's k rows summed in float32, in slot order,
    rounded once to src's dtype. As `src[rows].view(k, T, D).sum(0)`, without the `(k T, D)` tensor between."""
    src, rows = src.contiguous(), rows.contiguous()
    D, k = src.shape[1], rows.shape[0] // max(T, 1)
    out = src.new_empty((T, D))
    if T == 0 or D == 0:
        return out.zero_()
    bt, bd, warps = PAIR_SUMS_BLOCK
    with _moe_device(src):
        _pair_sums_kernel[(triton.cdiv(T, bt), triton.cdiv(D, bd))](src, rows, out, T, D, K=k, BLOCK_T=bt,
                                                                    BLOCK_D=bd, num_warps=warps)
    return out


class _SwiGLUWeighted(torch.autograd.Function):
    """`h (R, 2F)`, `w (R,)` -> `silu(gate) * up * w[:, None] (R, F)` in h's dtype; saves h and w alone (PyTorch's
    operators keep `silu(gate)` and the product too)."""

    @staticmethod
    def forward(ctx, h, w):
        h, w = h.contiguous(), w.contiguous()
        ctx.save_for_backward(h, w)
        R, Fh = h.shape[0], h.shape[1] // 2
        act = h.new_empty((R, Fh))
        if R and Fh:
            br, bf, warps = SWIGLU_BLOCK["forward"]
            with _moe_device(h):
                _swiglu_weighted_forward_kernel[(triton.cdiv(R, br), triton.cdiv(Fh, bf))](
                    h, w, act, R, Fh, BLOCK_R=br, BLOCK_F=bf, num_warps=warps)
        return act

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        R, Fh = h.shape[0], h.shape[1] // 2
        dh, dw = torch.empty_like(h), torch.zeros(R, dtype=torch.float32, device=h.device)
        if R and Fh:
            br, bf, warps = SWIGLU_BLOCK["backward"]
            with _moe_device(h):
                _swiglu_weighted_backward_kernel[(triton.cdiv(R, br),)](
                    g.contiguous().to(h.dtype), h, w, dh, dw, R, Fh, BLOCK_R=br, BLOCK_F=bf, num_warps=warps)
        else:
            dh.zero_()
        return dh, dw.to(w.dtype)


def swiglu_weighted(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up * w[:, None]` for `h = (gate | up) (R, 2F)` and the rows' routing weights `w (R,)` (float32,
    with their gradient): one kernel each way, in float32, rounded once to h's dtype."""
    return _SwiGLUWeighted.apply(h, w)
