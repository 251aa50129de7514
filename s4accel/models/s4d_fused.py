"""The chunked S4D convolution as one Triton kernel each way: every activation read and written once, for GPUs.

The same exact rewrite as `s4d_chunked.py` (its docs give the algebra), organised per program rather than per
product: a program owns one channel `h` and a block of `BB` batch rows, holds that channel's matrices on chip and
walks the chunks in order, carrying the state across them in registers:

    y_c     = x_c Toep + Re/Im(X_c) from_state        (BB, T) = (BB, T)(T, T) + (BB, n)(n, T), twice
    S_c     = x_c to_state^T                          (BB, n) real and imaginary parts, float32 accumulation
    X_(c+1) = dA^T X_c + S_c                          complex, elementwise in float32

The backward walks the chunks in reverse with the adjoint of the state, `A_c = dL/dX_c`
(`A_c = from_state-part of g_c + conj-free real-pair product of dA^T and A_(c+1)`): it reads `g` and the states once,
writes the input's gradient and the adjoints once (both `(H, B, nc, N)` in the operands' dtype, `N / T` of an
activation; the entering states `X_c` are kept from the forward). The matrices' gradients are then sums over every
(row, chunk) of products of what is stored, one batched matmul each (deterministic, no atomics); only dA^T's,
elementwise, is summed in the kernel, one partial sum per program.

Against the batched-matmul form this removes the `(H, N, B nc)` state tensors' round trips through memory, their
float32 copies and the strided adds of their gradients (the profile of that form on an H200 gave them about a
third of the layer's kernel time).

The matrices (float32, differentiable: the gradients this kernel returns for them flow on to `log_dt`, `A` and `C`
through PyTorch's autograd) are `s4d_chunked.matrices`, made here by two more small kernels, one launch each way
(`fused_matrices`, at the end), from the ZOH discretization made likewise (`fused_discretize`): in eager mode a
layer's forward and backward launch a few dozen kernels rather than a few hundred. Products take the operands'
dtype (bfloat16 under autocast) with float32 accumulation, as `tl.dot` does; the state recurrence is float32.

The slow references beside it are those of the chunked form: `s4d_chunked.conv_channels_first` (tests check this
kernel against it and against the float64 FFT convolution, values and every gradient). Without a GPU the tests run
the same kernels in Triton's interpreter (`TRITON_INTERPRET=1`, which runs a kernel's Python on the CPU).

Copied into Hub repositories with `modeling_s4.py`: it imports only torch (and Triton, which CUDA builds of PyTorch
bring, when present).
"""

import contextlib
import math
import os
import re

import torch

from .kernel_trials import kernels_fail
from .s4d_chunked import (discretize_pairs, discretize_through, fp32_or_wider, matrices, matrices_through,
                          parameter_pairs)

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU builds of PyTorch: this path is for GPUs
    triton = None

# Triton's interpreter runs a kernel on CPU tensors with NumPy, which has no bfloat16 products: there the operands
# are widened to float32 first (exact: a product of two bfloat16 numbers fits in float32's mantissa).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Batch rows (`BB`) and warps per program of each kernel. Both hold the chunk's matrices and a (BB, n) complex state;
# at chunks of 64 steps and N 64, compiled for sm_90 (H100/H200), 16 rows in 4 warps fit in registers without
# spilling, 32 rows spill (tests/models/test_s4d_fused.py checks it). bench/gpu_speed.py --sections fused_sweep
# times the alternatives on a GPU.
LAUNCH = {"forward": (16, 4), "backward": (16, 4)}
# Where a causal layer's GELU (between this convolution and the output projection) runs: "off", PyTorch's GELU
# after the kernels; "forward", the forward kernel writes GELU(y) beside y (which PyTorch's GELU backward reads):
# one read of y and one launch fewer; "both", it writes GELU(y) and GELU's slope, by which the backward kernel
# multiplies the gradient as it reads it: a read and a launch fewer each way. Off until a GPU has timed them: built
# for sm_90 at the defaults (bfloat16), "both" takes the forward and backward kernels from 142 and 160 registers a
# thread to 179 and 188, room for two programs an SM rather than three ("forward": 162, still three).
# `bench/gpu_speed.py --sections layer_fused` times each beside "off".
GELU_IN_KERNELS = "off"
GELU_MODES = ("off", "forward", "both")
# Whether the kernels cut the rows of a short batch into segments themselves (`kernel_segments`). A program owns one
# channel and `LAUNCH` rows and walks its rows' chunks in order: with fewer rows than that (a language-model step of
# 32K tokens has 4 rows at L 8,192, 2 at 16,384) the programs are as few as the channels and their chains as long
# as the sequence, and the GPU waits on that chain. Cut into S segments, a row is S rows of a program, each started
# from its true state: a first kernel walks each segment for its end state alone (`_end_state_kernel`: two products
# a chunk, no outputs), a scan over the S segments (`_segment_starts`, small) gives the state each starts from, and
# the forward kernel starts there; the backward likewise with the adjoint (`_start_adjoint_kernel`,
# `_segment_adjoints`). Exact to rounding, and unlike `s4d_segments.py` (a correction added to the outputs after
# the kernels, which on an H200 cost more than it saved) nothing the size of an activation is added: one more read
# of the input and of the gradient. Off until a GPU has timed it (`bench/gpu_speed.py --sections short_batches`).
SEGMENTS_IN_KERNELS = False


if triton is not None:
    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        if IEEE:  # float32 operands without TF32, as torch.matmul by default
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _gelu(v):
        """GELU of float32 `v`, exact (erf) and in the order of PyTorch's CUDA kernel (`GeluCUDAKernelImpl`)."""
        return v * 0.5 * (1.0 + tl.erf(v * 0.7071067811865476))

    @triton.jit
    def _gelu_grad(v):
        """d GELU(v) / dv for float32 `v`, as PyTorch's `GeluBackwardCUDAKernelImpl`: cdf + v pdf."""
        return 0.5 * (1.0 + tl.erf(v * 0.7071067811865476)) + v * (_exp(-0.5 * v * v) * 0.3989422804014327)

    @triton.jit
    def _row_pairs(init, h, rows, B, n: tl.constexpr, BB: tl.constexpr, keep, INIT: tl.constexpr):
        """Each row's complex (BB, n) float32 pair from `init` (H, B, N): real parts, then imaginary; zeros when
        not `INIT`."""
        if INIT:
            at = (h * B + rows[:, None].to(tl.int64)) * 2 * n + tl.arange(0, n)[None, :]
            p_r = tl.load(init + at, mask=keep, other=0.0)
            p_i = tl.load(init + at + n, mask=keep, other=0.0)
        else:
            p_r = tl.zeros((BB, n), dtype=tl.float32)
            p_i = tl.zeros((BB, n), dtype=tl.float32)
        return p_r, p_i

    @triton.jit
    def _end_state_kernel(x, to_state, step, ends, B, Lp, NC, T: tl.constexpr, n: tl.constexpr,
                          BB: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """The state each row of x (H, B, Lp) ends in from a zero one, `ends` (H, B, N) float32: the forward's
        state recurrence alone, two products a chunk rather than five and nothing written but the end."""
        h = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BB + tl.arange(0, BB)
        keep = (rows < B)[:, None]
        t = tl.arange(0, T)
        m = tl.arange(0, n)
        dt = x.dtype.element_ty
        pair = h * 2 * n * T + 2 * m * T
        to_r = tl.load(to_state + pair[None, :] + t[:, None]).to(dt)  # (T, n): to_state^T
        to_i = tl.load(to_state + pair[None, :] + T + t[:, None]).to(dt)
        g_r = tl.load(step + h * 2 * n + 2 * m)[None, :]
        g_i = tl.load(step + h * 2 * n + 2 * m + 1)[None, :]
        x_r = tl.zeros((BB, n), dtype=tl.float32)
        x_i = tl.zeros((BB, n), dtype=tl.float32)
        at = h * B * Lp + rows[:, None].to(tl.int64) * Lp + t[None, :]
        for c in tl.range(0, NC):
            xc = tl.load(x + at + c * T, mask=keep, other=0.0)
            s_r = _dot(xc, to_r, UPCAST, IEEE)
            s_i = _dot(xc, to_i, UPCAST, IEEE)
            x_r, x_i = x_r * g_r - x_i * g_i + s_r, x_r * g_i + x_i * g_r + s_i
        out = (h * B + rows[:, None].to(tl.int64)) * 2 * n + m[None, :]
        tl.store(ends + out, x_r, mask=keep)
        tl.store(ends + out + n, x_i, mask=keep)

    @triton.jit
    def _start_adjoint_kernel(g, slope, from_state, step, starts, B, Lp, NC, T: tl.constexpr, n: tl.constexpr,
                              BB: tl.constexpr, ACT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """dL/dX_0 of each row of the gradient g (H, B, Lp), the adjoint of the state entering its first chunk, from
        a zero one after its last: `starts` (H, B, N) float32. The backward's adjoint recurrence alone (two products
        a chunk); `ACT` as the backward kernel's."""
        h = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BB + tl.arange(0, BB)
        keep = (rows < B)[:, None]
        t = tl.arange(0, T)
        m = tl.arange(0, n)
        dt = g.dtype.element_ty
        pair = h * 2 * n * T + 2 * m * T
        from_r = tl.load(from_state + pair[None, :] + t[:, None]).to(dt)  # (T, n): from_state^T
        from_i = tl.load(from_state + pair[None, :] + T + t[:, None]).to(dt)
        g_r = tl.load(step + h * 2 * n + 2 * m)[None, :]
        g_i = tl.load(step + h * 2 * n + 2 * m + 1)[None, :]
        a_r = tl.zeros((BB, n), dtype=tl.float32)
        a_i = tl.zeros((BB, n), dtype=tl.float32)
        at = h * B * Lp + rows[:, None].to(tl.int64) * Lp + t[None, :]
        for cc in tl.range(0, NC):
            c = NC - 1 - cc
            gc = tl.load(g + at + c * T, mask=keep, other=0.0)
            if ACT:
                d = tl.load(slope + at + c * T, mask=keep, other=0.0).to(tl.float32)
                gc = (gc.to(tl.float32) * d).to(dt)
            e_r = _dot(gc, from_r, UPCAST, IEEE)
            e_i = _dot(gc, from_i, UPCAST, IEEE)
            a_r, a_i = e_r + a_r * g_r + a_i * g_i, e_i - a_r * g_i + a_i * g_r
        out = (h * B + rows[:, None].to(tl.int64)) * 2 * n + m[None, :]
        tl.store(starts + out, a_r, mask=keep)
        tl.store(starts + out + n, a_i, mask=keep)

    @triton.jit
    def _forward_kernel(x, taps, to_state, from_state, step, y, aux, states, init, B, Lp, NC, n_taps,
                        T: tl.constexpr, n: tl.constexpr, BB: tl.constexpr, SHIFT: tl.constexpr,
                        SAVE: tl.constexpr, ACT: tl.constexpr, INIT: tl.constexpr, UPCAST: tl.constexpr,
                        IEEE: tl.constexpr):
        """One (channel, block of rows) per program: y (H, B, Lp) from x (H, B, Lp), both in the operand dtype.
        `ACT` (`GELU_MODES`' index) 1 or 2: y is GELU of the convolution and, where the backward will need it
        (`SAVE`), `aux` the convolution itself (1) or GELU's slope there (2: the backward kernel multiplies by it;
        computing the slope in the backward kernel spilled). `INIT`: each row starts from the state in `init`
        (B, N) float32, real parts then imaginary (a segment of a longer row: `_segment_starts`), not from zero."""
        h = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BB + tl.arange(0, BB)
        keep = (rows < B)[:, None]
        t = tl.arange(0, T)
        m = tl.arange(0, n)
        dt = y.dtype.element_ty
        lag = t[None, :] - t[:, None] - SHIFT  # Toep[j, i] = taps[i - j - SHIFT] where i - j >= SHIFT
        toep = tl.load(taps + h * n_taps + lag, mask=lag >= 0, other=0.0).to(dt)  # (T, T)
        pair = h * 2 * n * T + 2 * m * T  # row (m, real) of a (H, N, T) matrix; (m, imaginary) is T further
        to_r = tl.load(to_state + pair[None, :] + t[:, None]).to(dt)  # (T, n): to_state^T, real rows
        to_i = tl.load(to_state + pair[None, :] + T + t[:, None]).to(dt)
        from_r = tl.load(from_state + pair[:, None] + t[None, :]).to(dt)  # (n, T)
        from_i = tl.load(from_state + pair[:, None] + T + t[None, :]).to(dt)
        g_r = tl.load(step + h * 2 * n + 2 * m)[None, :]  # dA^T, float32: (1, n)
        g_i = tl.load(step + h * 2 * n + 2 * m + 1)[None, :]
        x_r, x_i = _row_pairs(init, h, rows, B, n, BB, keep, INIT)  # the state entering the chunk
        at = h * B * Lp + rows[:, None].to(tl.int64) * Lp + t[None, :]  # (BB, T) offsets of chunk 0
        kept = h * B * NC * 2 * n + rows[:, None].to(tl.int64) * NC * 2 * n + m[None, :]
        for c in tl.range(0, NC):
            xc = tl.load(x + at + c * T, mask=keep, other=0.0)
            if SAVE:
                tl.store(states + kept + c * 2 * n, x_r.to(dt), mask=keep)
                tl.store(states + kept + c * 2 * n + n, x_i.to(dt), mask=keep)
            acc = _dot(xc, toep, UPCAST, IEEE)
            acc += _dot(x_r.to(dt), from_r, UPCAST, IEEE)
            acc += _dot(x_i.to(dt), from_i, UPCAST, IEEE)
            yc = acc.to(dt)
            if ACT == 0:
                tl.store(y + at + c * T, yc, mask=keep)
            else:  # GELU of y as rounded, as PyTorch's GELU after the kernel would compute it
                if SAVE and ACT == 1:  # (stored first: fewer registers live across the GELU)
                    tl.store(aux + at + c * T, yc, mask=keep)
                v = yc.to(tl.float32)
                tl.store(y + at + c * T, _gelu(v).to(dt), mask=keep)
                if SAVE and ACT == 2:
                    tl.store(aux + at + c * T, _gelu_grad(v).to(dt), mask=keep)
            s_r = _dot(xc, to_r, UPCAST, IEEE)
            s_i = _dot(xc, to_i, UPCAST, IEEE)
            x_r, x_i = x_r * g_r - x_i * g_i + s_r, x_r * g_i + x_i * g_r + s_i

    @triton.jit
    def _backward_kernel(g, slope, gy, states, taps, to_state, from_state, step, dx, adjoints, d_step, init,
                         B, Lp, NC, n_taps, T: tl.constexpr, n: tl.constexpr, BB: tl.constexpr,
                         SHIFT: tl.constexpr, ACT: tl.constexpr, INIT: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr):
        """The serial half of the backward: dx (H, B, Lp), the adjoints `A_(c+1)` each chunk's state update sends
        back (H, B, nc, N) in the operand dtype, and per program its partial sum of dA^T's gradient (float32). The
        matrices' gradients are batched matmuls of what is stored (`_backward`): no chain runs through them. With
        `ACT`, `g` is GELU's output's gradient: the convolution's, `g slope`, is made here and written to `gy` for
        them. `INIT`: the adjoint after each row's last chunk is `init`'s (B, N), not zero (`_segment_adjoints`)."""
        h = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1).to(tl.int64)
        nblk = tl.num_programs(1)
        rows = blk * BB + tl.arange(0, BB)
        keep = (rows < B)[:, None]
        t = tl.arange(0, T)
        m = tl.arange(0, n)
        dt = dx.dtype.element_ty
        lag = t[:, None] - t[None, :] - SHIFT  # Toep^T[i, j] = Toep[j, i]
        toep_t = tl.load(taps + h * n_taps + lag, mask=lag >= 0, other=0.0).to(dt)
        pair = h * 2 * n * T + 2 * m * T
        to_r = tl.load(to_state + pair[:, None] + t[None, :]).to(dt)  # (n, T)
        to_i = tl.load(to_state + pair[:, None] + T + t[None, :]).to(dt)
        from_r = tl.load(from_state + pair[None, :] + t[:, None]).to(dt)  # (T, n): from_state^T
        from_i = tl.load(from_state + pair[None, :] + T + t[:, None]).to(dt)
        g_r = tl.load(step + h * 2 * n + 2 * m)[None, :]
        g_i = tl.load(step + h * 2 * n + 2 * m + 1)[None, :]
        a_r, a_i = _row_pairs(init, h, rows, B, n, BB, keep, INIT)  # dL/dX_(c+1): after the last chunk, 0 or init
        acc_g_r = tl.zeros((n,), dtype=tl.float32)
        acc_g_i = tl.zeros((n,), dtype=tl.float32)
        at = h * B * Lp + rows[:, None].to(tl.int64) * Lp + t[None, :]
        kept = h * B * NC * 2 * n + rows[:, None].to(tl.int64) * NC * 2 * n + m[None, :]
        for cc in tl.range(0, NC):
            c = NC - 1 - cc
            gc = tl.load(g + at + c * T, mask=keep, other=0.0)
            if ACT:  # in float32, rounded to the operand dtype, as PyTorch's GELU backward
                d = tl.load(slope + at + c * T, mask=keep, other=0.0).to(tl.float32)
                gc = (gc.to(tl.float32) * d).to(dt)
                tl.store(gy + at + c * T, gc, mask=keep)
            ad_r = a_r.to(dt)
            ad_i = a_i.to(dt)
            tl.store(adjoints + kept + c * 2 * n, ad_r, mask=keep)
            tl.store(adjoints + kept + c * 2 * n + n, ad_i, mask=keep)
            dxc = _dot(gc, toep_t, UPCAST, IEEE)
            dxc += _dot(ad_r, to_r, UPCAST, IEEE)  # through S_c = x_c to_state^T, whose gradient is A_(c+1)
            dxc += _dot(ad_i, to_i, UPCAST, IEEE)
            tl.store(dx + at + c * T, dxc.to(dt), mask=keep)
            x_r = tl.load(states + kept + c * 2 * n, mask=keep, other=0.0).to(tl.float32)  # X_c
            x_i = tl.load(states + kept + c * 2 * n + n, mask=keep, other=0.0).to(tl.float32)
            acc_g_r += tl.sum(a_r * x_r + a_i * x_i, axis=0)  # X_(c+1) = dA^T X_c + S_c, complex
            acc_g_i += tl.sum(a_i * x_r - a_r * x_i, axis=0)
            e_r = _dot(gc, from_r, UPCAST, IEEE)  # dL/dX_c through y_c
            e_i = _dot(gc, from_i, UPCAST, IEEE)
            a_r, a_i = e_r + a_r * g_r + a_i * g_i, e_i - a_r * g_i + a_i * g_r
        part = h * nblk + blk
        tl.store(d_step + part * 2 * n + 2 * m, acc_g_r)
        tl.store(d_step + part * 2 * n + 2 * m + 1, acc_g_i)


def diagonal_sums(G: torch.Tensor, shift: int, m: int) -> torch.Tensor:
    """`G (H, T, T)` -> `(H, m)`: `[d] = sum_j G[j, j + d + shift]`, the gradient of Toeplitz taps (float32 or
    wider)."""
    H, T, _ = G.shape
    padded = torch.nn.functional.pad(G.contiguous(), (0, T))  # (H, T, 2T): [j, e] below reads [j, j + e]
    return padded.as_strided((H, T, T), (2 * T * T, 2 * T + 1, 1)).sum(1)[:, shift: shift + m]


# The launches as custom operators: `torch.compile` keeps each one whole in its graph (no graph break, and dynamo does
# not trace into Triton's launcher); their fake versions give it the outputs' shapes. Named after this module, so a
# copy of it saved with a model (a Hub repository's folded modeling file) registers operators of its own.
_NS = re.sub(r"\W", "_", __name__)


@torch.library.custom_op(f"{_NS}::forward", mutates_args=())
def _forward(x: torch.Tensor, taps: torch.Tensor, to_state: torch.Tensor, from_state: torch.Tensor,
             step: torch.Tensor, T: int, shift: int, save: bool, ieee: bool, act: int,
             segments: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y (H, B, Lp) (`act` 1 or 2: GELU of the convolution); with `save`, `act`'s tensor for the backward (1: the
    convolution, 2: GELU's slope, (H, B, Lp)) and the states entering each chunk (H, B, nc, N); all in x's dtype
    (placeholders where there is nothing to keep). `segments` S > 1: each row read as S rows of nc / S chunks, each
    started from its true state (`_segment_starts`, from each segment's end state from zero)."""
    H, B, Lp = x.shape
    nc, n = Lp // T, step.shape[1]
    y = torch.empty_like(x)
    aux = torch.empty_like(x) if act and save else x.new_empty((1,))
    states = x.new_empty((H, B, nc, 2 * n) if save else (1,))
    rows, warps = LAUNCH["forward"]
    S = segments
    R, grid = B * S, (H, triton.cdiv(B * S, rows))  # (H, B, Lp) read as (H, B S, Lp / S): the same memory
    init = x  # (read only with INIT)
    with _on(x):
        if S > 1:
            ends = torch.empty((H, R, 2 * n), dtype=torch.float32, device=x.device)
            _end_state_kernel[grid](x, to_state, step, ends, R, Lp // S, nc // S, T=T, n=n, BB=rows,
                                    UPCAST=INTERPRETED, IEEE=ieee, num_warps=warps)
            init = _segment_starts(ends.view(H, B, S, 2 * n), step, nc // S)
        _forward_kernel[grid](
            x, taps, to_state, from_state, step, y, aux, states, init, R, Lp // S, nc // S, taps.shape[-1],
            T=T, n=n, BB=rows, SHIFT=shift, SAVE=save, ACT=act, INIT=S > 1, UPCAST=INTERPRETED, IEEE=ieee,
            num_warps=warps)
    return y, aux, states


def _segment_starts(ends: torch.Tensor, step: torch.Tensor, m: int) -> torch.Tensor:
    """`ends (H, B, S, N)` float32, the state each segment of m chunks ends in from a zero one -> the state each
    starts from, `(H, B S, N)`: `X_0 = 0`, `X_(s+1) = (dA^T)^m X_s + E_s` (complex, per mode; S is small)."""
    H, B, S, N = ends.shape
    n = N // 2
    P = torch.complex(step[..., 0], step[..., 1]).pow(m)[:, None]  # (H, 1, n)
    E = torch.complex(ends[..., :n], ends[..., n:])
    X = [torch.zeros_like(E[:, :, 0])]
    for s in range(S - 1):
        X.append(P * X[-1] + E[:, :, s])
    X = torch.stack(X, 2)
    return torch.cat([X.real, X.imag], -1).reshape(H, B * S, N).contiguous()


def _segment_adjoints(starts: torch.Tensor, step: torch.Tensor, m: int) -> torch.Tensor:
    """`starts (H, B, S, N)` float32, each segment's adjoint at its start (dL/dX_0) from its own outputs alone ->
    the adjoint each segment's backward starts from after its last chunk, `(H, B S, N)`: with `D_S = 0` and
    `D_s = G_s + conj(dA^T)^m D_(s+1)`, segment s starts from `D_(s+1)`."""
    H, B, S, N = starts.shape
    n = N // 2
    P = torch.complex(step[..., 0], -step[..., 1]).pow(m)[:, None]
    G = torch.complex(starts[..., :n], starts[..., n:])
    D = [torch.zeros_like(G[:, :, 0])]  # D_S, D_(S-1), ..., D_1
    for s in range(S - 1, 0, -1):
        D.append(G[:, :, s] + P * D[-1])
    D = torch.stack(D[::-1], 2)  # [s] = D_(s+1)
    return torch.cat([D.real, D.imag], -1).reshape(H, B * S, N).contiguous()


@_forward.register_fake
def _forward_fake(x, taps, to_state, from_state, step, T, shift, save, ieee, act, segments):
    H, B, Lp = x.shape
    return (torch.empty_like(x), torch.empty_like(x) if act and save else x.new_empty((1,)),
            x.new_empty((H, B, Lp // T, 2 * step.shape[1]) if save else (1,)))


@torch.library.custom_op(f"{_NS}::backward", mutates_args=())
def _backward(x: torch.Tensor, g: torch.Tensor, slope: torch.Tensor | None, states: torch.Tensor, taps: torch.Tensor,
              to_state: torch.Tensor, from_state: torch.Tensor, step: torch.Tensor, T: int, shift: int, ieee: bool,
              segments: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx and the matrices' gradients: taps (H, m), to_state and from_state (H, N, T), step (H, n, 2), float32.
    `slope`: GELU's slope, where the forward kernel applied GELU and kept it (`GELU_MODES` "both"; `g` is then
    GELU's output's gradient), else None. `segments` as the forward's: each segment's walk starts from the adjoint
    the later ones send back (`_segment_adjoints`, from each segment's own adjoint at its start).
    The kernel walks the chunks backwards for dx and the adjoints; the matrices' gradients are then sums over every
    (row, chunk) pair, one batched matmul each (cuBLAS, float32 accumulation and output):

        d Toep       = sum x_c^T g_c      d to_state = sum A_(c+1)^T x_c      d from_state = sum X_c^T g_c

    (they were accumulated in the kernel's registers before: five more products a chunk, on tiles with 16 rows, in
    a program that must also carry the serial chain; this way the chain's kernel is as light as the forward's)."""
    H, B, Lp = x.shape
    nc, n = Lp // T, step.shape[1]
    rows, warps = LAUNCH["backward"]
    S = segments
    R, nblk = B * S, triton.cdiv(B * S, rows)
    dx = torch.empty_like(x)
    gy = g if slope is None else torch.empty_like(x)  # the convolution's gradient, made by the kernel after GELU
    adjoints = torch.empty_like(states)  # (H, B, nc, N), as the states
    d_step = torch.empty((H, nblk, n, 2), dtype=torch.float32, device=x.device)
    init = g  # (read only with INIT)
    with _on(x):
        if S > 1:
            starts = torch.empty((H, R, 2 * n), dtype=torch.float32, device=x.device)
            _start_adjoint_kernel[(H, nblk)](g, g if slope is None else slope, from_state, step, starts, R, Lp // S,
                                             nc // S, T=T, n=n, BB=rows, ACT=slope is not None, UPCAST=INTERPRETED,
                                             IEEE=ieee, num_warps=warps)
            init = _segment_adjoints(starts.view(H, B, S, 2 * n), step, nc // S)
        _backward_kernel[(H, nblk)](
            g, g if slope is None else slope, gy, states, taps, to_state, from_state, step, dx, adjoints, d_step,
            init, R, Lp // S, nc // S, taps.shape[-1], T=T, n=n, BB=rows, SHIFT=shift, ACT=slope is not None,
            INIT=S > 1, UPCAST=INTERPRETED, IEEE=ieee, num_warps=warps)
    xs, gs = x.view(H, B * nc, T), gy.view(H, B * nc, T)  # one row per (batch row, chunk)
    d_toep = _sum_of_products(xs, gs)  # (H, T, T)
    d_to = _sum_of_products(adjoints.view(H, B * nc, 2 * n), xs)  # (H, N, T): real rows, then imaginary
    d_from = _sum_of_products(states.view(H, B * nc, 2 * n), gs)

    def interleave(d):  # to the matrices' row order: (m, real), (m, imaginary)
        return d.view(H, 2, n, T).transpose(1, 2).reshape(H, 2 * n, T)
    d_taps = diagonal_sums(d_toep, shift, taps.shape[-1]).contiguous()
    return dx, d_taps, interleave(d_to), interleave(d_from), d_step.sum(1)


def _sum_of_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a^T b` for `a (H, K, P)`, `b (H, K, Q)` -> `(H, P, Q)` in float32: half-precision operands with float32
    accumulation and output on CUDA (`out_dtype`, as the kernels' `tl.dot`), widened first elsewhere (CPU matmuls
    have no `out_dtype`; the product of two bfloat16 numbers is exact in float32, so the sums agree). float32
    operands: TF32 where PyTorch allows it, IEEE products otherwise, as the kernels (`ieee_products`)."""
    a = a.transpose(1, 2)
    if a.dtype in (torch.bfloat16, torch.float16):  # (the kernels take no other dtype but float32)
        if a.is_cuda:
            return torch.bmm(a, b, out_dtype=torch.float32)
        return torch.bmm(a.float(), b.float())
    return torch.bmm(a, b)


@_backward.register_fake
def _backward_fake(x, g, slope, states, taps, to_state, from_state, step, T, shift, ieee, segments):
    return (torch.empty_like(x), torch.empty_like(taps), torch.empty_like(to_state), torch.empty_like(from_state),
            torch.empty_like(step))


class _FusedConv(torch.autograd.Function):
    """`x (H, B, nc T)` -> `y` of the same shape and dtype (`gelu` 1 or 2: GELU of it, as `GELU_MODES` says), from
    the float32 matrices of `chunk_matrices` and `dA^T (H, n, 2)`; the backward returns x's gradient and the
    matrices' (float32)."""

    @staticmethod
    def forward(ctx, x, taps, to_state, from_state, step, T: int, shift: int, gelu: int, segments: int):
        save = any(ctx.needs_input_grad[:5])
        ieee = ieee_products(x.dtype)
        y, aux, states = _forward(x, taps, to_state, from_state, step, T, shift, save, ieee, gelu, segments)
        ctx.save_for_backward(x, states, taps, to_state, from_state, step, aux if gelu else None)
        ctx.T, ctx.shift, ctx.ieee, ctx.gelu, ctx.segments = T, shift, ieee, gelu, segments
        return y

    @staticmethod
    def backward(ctx, g):
        x, states, taps, to_state, from_state, step, aux = ctx.saved_tensors
        g = g.contiguous().to(x.dtype)
        if ctx.gelu == 1:  # PyTorch's GELU backward, from the convolution the forward kernel kept
            g = torch.ops.aten.gelu_backward(g, aux)
        grads = _backward(x, g, aux if ctx.gelu == 2 else None, states, taps, to_state, from_state, step, ctx.T,
                          ctx.shift, ctx.ieee, ctx.segments)
        return *grads, None, None, None, None


def gelu_in_kernels() -> int:
    """`GELU_IN_KERNELS` as the kernels take it: its index in `GELU_MODES` (0: PyTorch's GELU after them)."""
    return GELU_MODES.index(GELU_IN_KERNELS)


def ieee_products(dtype: torch.dtype) -> bool:
    """Whether the kernels multiply operands of `dtype` in IEEE float32 (float32 without TF32, as torch.matmul does
    unless TF32 is allowed)."""
    return dtype == torch.float32 and not _tf32_allowed()


@torch.compiler.assume_constant_result
def _tf32_allowed() -> bool:
    """torch's TF32 switch for matmuls, a constant to `torch.compile` (set once, before a run's first step)."""
    return torch.backends.cuda.matmul.allow_tf32


def _on(x: torch.Tensor):
    """Triton launches on the current CUDA device: make it x's (under `torch.compile`, inductor does this itself)."""
    if x.is_cuda and not torch.compiler.is_compiling():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def kernel_segments(B: int, nc: int) -> int:
    """How many segments the kernels cut each of B rows of nc chunks into (`SEGMENTS_IN_KERNELS`; else 1): the
    smallest power of two that fills a program's rows, dividing nc."""
    rows = min(LAUNCH["forward"][0], LAUNCH["backward"][0])
    S = 1
    while SEGMENTS_IN_KERNELS and B * S < rows and nc % (2 * S) == 0:
        S *= 2
    return S


def fused_conv_channels_first(x: torch.Tensor, taps, to_state, from_state, step, shift: int = 0,
                              gelu: int = 0, segments: int | None = None) -> torch.Tensor:
    """The chunked convolution of `x (H, B, nc T)` (channels first, zero-padded past the sequence) in one kernel:
    `taps (H, T - shift)`, `to_state`/`from_state (H, N, T)` from `chunk_matrices`, `step (H, N/2, 2)` = dA^T as
    (real, imaginary). Returns `(H, B, nc T)` in x's dtype. The matrices must be float32 (the kernel reads them as
    such); T and N/2 powers of two of at least 16 (`tl.dot`'s smallest tile). `gelu` 1 or 2 (`GELU_MODES`' index):
    GELU of the result (exact, as `torch.nn.functional.gelu` of it), applied as the kernel writes it; 2 also writes
    its slope, by which the backward kernel multiplies the gradient as it reads it (the same memory kept for the
    backward as 1's convolution; in half precision the slope is rounded to it: one rounding more than PyTorch's GELU
    backward, 2^-9 of the gradient in bfloat16). `segments`: how many segments the kernels cut each row into
    (default: `kernel_segments`)."""
    T = to_state.shape[-1]
    S = kernel_segments(x.shape[1], x.shape[2] // T) if segments is None else segments
    if (x.shape[2] // T) % S:
        raise ValueError(f"{S} segments do not divide a row of {x.shape[2] // T} chunks")
    return _FusedConv.apply(x.contiguous(), taps.float().contiguous(), to_state.float().contiguous(),
                            from_state.float().contiguous(), step.float().contiguous(), T, shift, gelu, S)


def supports(T: int, N: int) -> bool:
    """Whether the kernel takes chunks of T steps and a state of N (real) rows: powers of two, T and N/2 >= 16, T at
    most 128 (a program holds T x T matrices: at 256 they pass an SM's shared memory)."""
    n = N // 2
    return 16 <= T <= 128 and n >= 16 and T & (T - 1) == 0 and n & (n - 1) == 0


def why_not_fused(device_type: str, dtype: torch.dtype, T: int, N: int, zoh: bool = True) -> str | None:
    """Why the fused kernels cannot compute a layer with chunks of T steps and state size N on `device_type` with
    `dtype` operands, or None where they can (on CUDA: where they pass their trial on this GPU, `kernels_fail`;
    `zoh`: the layer's discretization is ZOH, whose kernel the trial then runs too)."""
    if triton is None:
        return "it needs Triton"
    if not (device_type == "cuda" or (INTERPRETED and device_type == "cpu")):
        return "it runs on CUDA devices"
    if dtype == torch.float64:
        return "it takes bfloat16 or float32 operands"
    if not supports(T, N):
        return (f"it needs d_state/2 and conv_chunk powers of two >= 16, conv_chunk <= 128 (d_state={N}, "
                f"conv_chunk={T})")
    if dtype == torch.float32 and T > 64:  # compiled for sm_90: the backward's float32 tiles need 256 KiB at T 128
        return f"with float32 operands it takes chunks of at most 64 steps (conv_chunk={T})"
    if device_type == "cuda":
        why = kernels_fail("The fused S4 kernels", "S4 layers take the chunked path (PyTorch's batched matmuls)",
                           (dtype, T, N, zoh, GELU_IN_KERNELS, SEGMENTS_IN_KERNELS, ieee_products(dtype)),
                           lambda device: _fused_trial(device, dtype, T, N // 2, zoh))
        if why:
            return f"its Triton kernels fail on this GPU ({why})"
    return None


def _fused_trial(device: torch.device, dtype: torch.dtype, T: int, n: int, zoh: bool) -> None:
    """One forward and backward of every kernel a layer launches with chunks of T steps and n modes (the
    discretization where `zoh`, the matrices and the convolution, GELU and segments as the switches say), on a few
    rows of two chunks: `kernels_fail`'s trial before `why_not_fused` lets a layer take them."""
    H, B = 2, 1 if SEGMENTS_IN_KERNELS else LAUNCH["forward"][0]

    def leaf(shape, value):  # made on the device: no copy from the host
        return torch.full(shape, value, device=device, requires_grad=True)
    log_dt, log_A_real, D = leaf((H,), math.log(0.01)), leaf((H, n), math.log(0.5)), leaf((H,), 1.0)
    A_imag = (math.pi * torch.arange(n, dtype=torch.float32, device=device)).expand(H, n).clone().requires_grad_()
    C = leaf((1, H, n, 2), 0.5)
    (ar, ai), (cr, ci) = fused_discretize(log_dt, log_A_real, A_imag, C, zoh)
    taps, to_state, from_state, step = fused_matrices((ar, ai), (cr[0], ci[0]), D, T)
    x = torch.ones((H, B, 2 * T), dtype=dtype, device=device, requires_grad=True)
    y = fused_conv_channels_first(x, taps, to_state, from_state, step, gelu=gelu_in_kernels())
    y.float().sum().backward()


def fused_matrices(log_dA, C_tilde, D, T: int, shift: int = 0):
    """`chunk_matrices`' taps, to_state and from_state for chunks of T steps, and `dA^T` as `(H, N/2, 2)` (the
    kernel carries the state across chunks one step of `dA^T` at a time rather than by the scan matrix). Where the
    Triton kernels run (float32 parameters, T and N/2 as `supports` wants), one launch each way (`_KernelMatrices`);
    elsewhere `s4d_chunked.matrices`, their reference."""
    ar = log_dA[0]
    if (triton is None or ar.dtype != torch.float32 or not (ar.is_cuda or INTERPRETED)
            or not supports(T, 2 * ar.shape[-1])):
        return matrices(log_dA, C_tilde, D, T, shift)
    return _KernelMatrices.apply(*log_dA, *C_tilde, D, T, shift)


def fused_discretize(log_dt: torch.Tensor, log_A_real: torch.Tensor, A_imag: torch.Tensor, C: torch.Tensor,
                     zoh: bool, copies: int = 1):
    """`s4d_chunked.discretize_pairs` of the S4D parameters as stored (`parameter_pairs`: log_dt (H,), log_A_real
    and A_imag (H / copies, n), C (c, H, n, 2)), with its results, in one Triton launch each way where the kernels
    run (ZOH, float32, one SSM per channel, n a power of two): the parametrization's exponentials and C's halves are
    read inside the kernels rather than launched before them. Elsewhere `discretize_pairs(*parameter_pairs(...))`,
    its reference."""
    # widened as `parameter_pairs` widens them: a no-op for the float32 a model keeps
    params = tuple(fp32_or_wider(p) for p in (log_dt, log_A_real, A_imag, C))
    n = log_A_real.shape[-1]
    if (triton is None or not zoh or copies != 1 or any(p.dtype != torch.float32 for p in params)
            or not (log_dt.is_cuda or INTERPRETED) or n & (n - 1)):
        return discretize_pairs(*parameter_pairs(*params, copies), zoh)
    ar, ai, cr, ci = _KernelDiscretize.apply(*params)
    return (ar, ai), (cr, ci)


# ----------------------------------------------------------------------------------------------------------------
# The matrices themselves. `s4d_chunked.matrices` writes them, forward and backward, in about 60 PyTorch operations
# on (H, N/2, T) tensors: in eager mode 60 kernel launches a layer, which the host pays for while the GPU, done with
# such small tensors at once, waits (bench/launches.py counts them; at L 1,024 the eager layer took 6.4 ms of wall
# time for 2.4 ms of kernels on an H200). Here each direction is one program per channel, the powers `P_e = dA^e`
# computed in registers where an output needs them:
#
#     taps[j]            = 2 Re(sum_m C~_m P_j)     (+ D at j = 0), j < T - shift
#     to_state[(m,.), j] = P_(T-1-j)               (real, imaginary rows)
#     from_state[(m,.), i] = (2 Re, -2 Im) of C~_m P_(i+1-shift)
#     step[m]            = P_T
#
# The backward sums, per mode, what each output sends back to `Q = C~ P` and to `P` at each exponent e, then
# `g_C~ = sum_e conj(P_e) g_Q(e)` and `g_(log dA) = sum_e e conj(P_e) (conj(C~) g_Q(e) + g_P(e))` (the chain rule of
# `_Matrices.backward`, grouped by output rather than by exponent).

if triton is not None:
    @triton.jit
    def _powers(ar, ai, e):
        """dA^e = exp(e log dA) for modes `(n, 1)` and exponents `e (1, T)` -> real and imaginary `(n, T)`."""
        magnitude = tl.exp(ar * e)
        return magnitude * tl.cos(ai * e), magnitude * tl.sin(ai * e)

    @triton.jit
    def _matrices_forward_kernel(ar, ai, cr, ci, D, taps, to_state, from_state, step, T: tl.constexpr,
                                 n: tl.constexpr, TB: tl.constexpr, SHIFT: tl.constexpr, HAS_D: tl.constexpr):
        """One channel per program, its steps in blocks of TB (an (n, TB) tile stays in registers)."""
        h = tl.program_id(0).to(tl.int64)
        m = tl.arange(0, n)
        a_r = tl.load(ar + h * n + m)[:, None]  # (n, 1)
        a_i = tl.load(ai + h * n + m)[:, None]
        c_r = tl.load(cr + h * n + m)[:, None]
        c_i = tl.load(ci + h * n + m)[:, None]
        for j0 in tl.range(0, T, TB):
            j = j0 + tl.arange(0, TB)
            t = j[None, :].to(tl.float32)  # (1, TB)
            p_r, p_i = _powers(a_r, a_i, t)  # the taps: P_j
            k = 2 * tl.sum(c_r * p_r - c_i * p_i, axis=0)  # (TB,)
            if HAS_D:
                k += tl.where(j == 0, tl.load(D + h), 0.0)
            tl.store(taps + h * (T - SHIFT) + j, k, mask=j < T - SHIFT)
            rows = h * 2 * n * T + 2 * m[:, None] * T + j[None, :]  # (m, real) rows; (m, imaginary): T further
            p_r, p_i = _powers(a_r, a_i, (T - 1) - t)
            tl.store(to_state + rows, p_r)
            tl.store(to_state + rows + T, p_i)
            p_r, p_i = _powers(a_r, a_i, t + (1 - SHIFT))
            tl.store(from_state + rows, 2 * (c_r * p_r - c_i * p_i))
            tl.store(from_state + rows + T, -2 * (c_r * p_i + c_i * p_r))
        p_r, p_i = _powers(a_r, a_i, tl.full((1, 1), T, tl.float32))
        tl.store(step + h * 2 * n + 2 * m[:, None], p_r)
        tl.store(step + h * 2 * n + 2 * m[:, None] + 1, p_i)

    @triton.jit
    def _matrices_backward_kernel(ar, ai, cr, ci, g_taps, g_to, g_from, g_step, d_ar, d_ai, d_cr, d_ci,
                                  T: tl.constexpr, n: tl.constexpr, TB: tl.constexpr, SHIFT: tl.constexpr):
        """One channel per program: the sums over its steps, in blocks of TB, of what each output sends back."""
        h = tl.program_id(0).to(tl.int64)
        m = tl.arange(0, n)
        a_r = tl.load(ar + h * n + m)[:, None]
        a_i = tl.load(ai + h * n + m)[:, None]
        c_r = tl.load(cr + h * n + m)[:, None]
        c_i = tl.load(ci + h * n + m)[:, None]
        ga_r = tl.zeros((n,), tl.float32)  # the gradient of log dA
        ga_i = tl.zeros((n,), tl.float32)
        gc_r = tl.zeros((n,), tl.float32)  # of C~
        gc_i = tl.zeros((n,), tl.float32)
        for j0 in tl.range(0, T, TB):
            j = j0 + tl.arange(0, TB)
            t = j[None, :].to(tl.float32)
            rows = h * 2 * n * T + 2 * m[:, None] * T + j[None, :]
            # the taps: g_Q(e) = 2 g_taps[e] (real), e = j
            gq_r = 2 * tl.load(g_taps + h * (T - SHIFT) + j, mask=j < T - SHIFT, other=0.0)[None, :]  # (1, TB)
            p_r, p_i = _powers(a_r, a_i, t)
            gc_r += tl.sum(p_r * gq_r, axis=1)  # conj(P) g_Q
            gc_i += tl.sum(-p_i * gq_r, axis=1)
            w_r, w_i = c_r * gq_r, -c_i * gq_r  # conj(C~) g_Q
            ga_r += tl.sum(t * (p_r * w_r + p_i * w_i), axis=1)  # e conj(P) w
            ga_i += tl.sum(t * (p_r * w_i - p_i * w_r), axis=1)
            # from_state: g_Q(e) = (2 g_re, -2 g_im), e = i + 1 - SHIFT
            e = t + (1 - SHIFT)
            gq_r = 2 * tl.load(g_from + rows)
            gq_i = -2 * tl.load(g_from + rows + T)
            p_r, p_i = _powers(a_r, a_i, e)
            gc_r += tl.sum(p_r * gq_r + p_i * gq_i, axis=1)
            gc_i += tl.sum(p_r * gq_i - p_i * gq_r, axis=1)
            w_r, w_i = c_r * gq_r + c_i * gq_i, c_r * gq_i - c_i * gq_r
            ga_r += tl.sum(e * (p_r * w_r + p_i * w_i), axis=1)
            ga_i += tl.sum(e * (p_r * w_i - p_i * w_r), axis=1)
            # to_state: g_P(e) directly, e = T - 1 - j
            e = (T - 1) - t
            w_r = tl.load(g_to + rows)
            w_i = tl.load(g_to + rows + T)
            p_r, p_i = _powers(a_r, a_i, e)
            ga_r += tl.sum(e * (p_r * w_r + p_i * w_i), axis=1)
            ga_i += tl.sum(e * (p_r * w_i - p_i * w_r), axis=1)
        # dA^T: g_P(T)
        w_r = tl.load(g_step + h * 2 * n + 2 * m)
        w_i = tl.load(g_step + h * 2 * n + 2 * m + 1)
        p_r, p_i = _powers(a_r, a_i, tl.full((1, 1), T, tl.float32))
        p_r, p_i = tl.sum(p_r, axis=1), tl.sum(p_i, axis=1)  # (n,)
        ga_r += T * (p_r * w_r + p_i * w_i)
        ga_i += T * (p_r * w_i - p_i * w_r)
        tl.store(d_ar + h * n + m, ga_r)
        tl.store(d_ai + h * n + m, ga_i)
        tl.store(d_cr + h * n + m, gc_r)
        tl.store(d_ci + h * n + m, gc_i)


def _steps_a_block(T: int, n: int, forward: bool = False) -> int:
    """The matrices kernels' block of steps: an (n, TB) float32 tile of 512 values at most, which 4 warps hold
    without spilling on sm_90 (whole (n, T) tiles spill at T 128, N 64, and 1,024-value ones a little;
    tests/models/test_s4d_fused.py compiles them for it). The forward's at N 256: 256 values, as Triton 3.6's ptxas
    (torch 2.11's, the GPU machines') spilled 8 bytes a thread at 512, where Triton 3.9's spilled none."""
    return max(1, min(T, (256 if forward and n >= 128 else 512) // n))


@torch.library.custom_op(f"{_NS}::matrices", mutates_args=())
def _matrices_forward(ar: torch.Tensor, ai: torch.Tensor, cr: torch.Tensor, ci: torch.Tensor, D: torch.Tensor,
                      T: int, shift: int, has_D: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    """taps (H, T - shift), to_state and from_state (H, N, T), step (H, n, 2), float32, from `(H, n)` float32 pairs
    and D (H,) (read only with `has_D`)."""
    H, n = ar.shape
    taps, step = ar.new_empty(H, T - shift), ar.new_empty(H, n, 2)
    to_state, from_state = ar.new_empty(H, 2 * n, T), ar.new_empty(H, 2 * n, T)
    with _on(ar):
        _matrices_forward_kernel[(H,)](ar, ai, cr, ci, D, taps, to_state, from_state, step, T=T, n=n,
                                       TB=_steps_a_block(T, n, forward=True), SHIFT=shift, HAS_D=has_D,
                                       num_warps=4)
    return taps, to_state, from_state, step


@_matrices_forward.register_fake
def _matrices_forward_fake(ar, ai, cr, ci, D, T, shift, has_D):
    H, n = ar.shape
    return ar.new_empty(H, T - shift), ar.new_empty(H, 2 * n, T), ar.new_empty(H, 2 * n, T), ar.new_empty(H, n, 2)


@torch.library.custom_op(f"{_NS}::matrices_backward", mutates_args=())
def _matrices_backward(ar: torch.Tensor, ai: torch.Tensor, cr: torch.Tensor, ci: torch.Tensor, g_taps: torch.Tensor,
                       g_to: torch.Tensor, g_from: torch.Tensor, g_step: torch.Tensor,
                       T: int, shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `log dA` and `C~` (each `(H, n)` real, imaginary), float32."""
    H, n = ar.shape
    grads = [torch.empty_like(ar) for _ in range(4)]
    with _on(ar):
        _matrices_backward_kernel[(H,)](ar, ai, cr, ci, g_taps, g_to, g_from, g_step, *grads, T=T, n=n,
                                        TB=_steps_a_block(T, n), SHIFT=shift, num_warps=4)
    return tuple(grads)


@_matrices_backward.register_fake
def _matrices_backward_fake(ar, ai, cr, ci, g_taps, g_to, g_from, g_step, T, shift):
    return tuple(torch.empty_like(ar) for _ in range(4))


class _KernelMatrices(torch.autograd.Function):
    """`s4d_chunked.matrices` in one Triton launch each way (the gradients of D: the taps' at lag 0)."""

    @staticmethod
    def forward(ctx, ar, ai, cr, ci, D, T: int, shift: int):
        params = [p.contiguous() for p in (ar, ai, cr, ci)]
        has_D = D is not None
        out = _matrices_forward(*params, D.contiguous() if has_D else params[0], T, shift, has_D)
        ctx.save_for_backward(*params, D)
        ctx.T, ctx.shift, ctx.has_D = T, shift, has_D
        return out

    @staticmethod
    def backward(ctx, g_taps, g_to, g_from, g_step):
        ar, ai, cr, ci, D = ctx.saved_tensors
        if torch.is_grad_enabled():  # a second derivative wanted (create_graph): the reference's graph gives it
            return *matrices_through((ar, ai, cr, ci, D if ctx.has_D else None), (g_taps, g_to, g_from, g_step),
                                     ctx.T, ctx.shift), None, None
        outs = [g.contiguous() for g in (g_taps, g_to, g_from, g_step)]  # (an unused output's: zeros)
        grads = _matrices_backward(ar, ai, cr, ci, *outs, ctx.T, ctx.shift)
        return *grads, (g_taps[:, 0] if ctx.has_D else None), None, None



# ----------------------------------------------------------------------------------------------------------------
# The discretization (ZOH) likewise, one program per channel over its modes and kernels (c: 1, or 2 bidirectional),
# from the parameters as stored:
#
#     dt = exp(log_dt),   A = -exp(log_A_real) + i A_imag,   log dA = dt A,   dB = (exp(dt A) - 1) / A,   C~ = C dB
#
# and its backward as `s4d_chunked._Discretize.backward` writes it (the ZOH branch), then through the two
# exponentials (`d exp(x) / dx = exp(x)`), about 70 eager operations forward and backward together before.

if triton is not None:
    _COMPILED = tl.constexpr(not INTERPRETED)

    @triton.jit
    def _exp(x):
        """exp(x) as the reference computes it, to 2 ulp: compiled, libdevice's expf. (`tl.exp` is `ex2.approx` of
        x log2(e), whose product's rounding alone can cost ulps in proportion to |x|, and log_dt reaches -7: on an
        H200 the float32 layer's input gradient at L 3,000 was 1.6x further from float64 than with PyTorch's
        discretization. The interpreter, which has no libdevice, runs NumPy's.)"""
        if _COMPILED:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _expm1(x):
        """exp(x) - 1 without the cancellation near 0 (Triton has no expm1): its Taylor series below 0.1, where the
        first term left out is below 3e-13 of the value; exp(x) - 1 from there, which loses at most 2^-24 / 0.1."""
        small = x * (1 + x / 2 * (1 + x / 3 * (1 + x / 4 * (1 + x / 5 * (1 + x / 6 * (1 + x / 7))))))
        return tl.where(tl.abs(x) < 0.1, small, _exp(x) - 1)

    @triton.jit
    def _zoh(dt, a_r, a_i):
        """dt A, dB and exp(dt A), each as (real, imaginary)."""
        ar, ai = dt * a_r, dt * a_i
        cos, e, half = tl.cos(ai), _exp(ar), tl.sin(ai / 2)
        num_r = _expm1(ar) * cos - 2 * half * half  # Re(exp(dt A) - 1), cos - 1 as -2 sin^2(ai / 2): no cancellation
        num_i = e * tl.sin(ai)
        norm = a_r * a_r + a_i * a_i  # (divisions rounded as IEEE's: `/` compiles to a 2-ulp approximation)
        db_r = tl.math.div_rn(num_r * a_r + num_i * a_i, norm)
        db_i = tl.math.div_rn(num_i * a_r - num_r * a_i, norm)
        return ar, ai, db_r, db_i, e * cos, num_i

    @triton.jit
    def _parameters(log_dt, log_a, a_imag, h, m):
        """dt and A's (real, imaginary) parts of channel h's modes m, from the stored parameters."""
        return _exp(tl.load(log_dt + h)), -_exp(tl.load(log_a + m)), tl.load(a_imag + m)

    @triton.jit
    def _discretize_forward_kernel(log_dt, log_a, a_imag, C, ar, ai, ctr, cti, H, n: tl.constexpr,
                                   c: tl.constexpr):
        h = tl.program_id(0).to(tl.int64)
        m = h * n + tl.arange(0, n)
        log_r, log_i, db_r, db_i, _, _ = _zoh(*_parameters(log_dt, log_a, a_imag, h, m))
        tl.store(ar + m, log_r)
        tl.store(ai + m, log_i)
        for k in tl.static_range(c):  # C~ = C dB for each kernel; C (c, H, n, 2) holds (real, imaginary) pairs
            at = k * H * n + m
            c_r, c_i = tl.load(C + 2 * at), tl.load(C + 2 * at + 1)
            tl.store(ctr + at, c_r * db_r - c_i * db_i)
            tl.store(cti + at, c_r * db_i + c_i * db_r)

    @triton.jit
    def _discretize_backward_kernel(log_dt, log_a, a_imag, C, g_ar, g_ai, g_cr, g_ci, d_log_dt, d_log_a, d_a_imag,
                                    d_C, H, n: tl.constexpr, c: tl.constexpr):
        h = tl.program_id(0).to(tl.int64)
        m = h * n + tl.arange(0, n)
        step, a_r, a_i = _parameters(log_dt, log_a, a_imag, h, m)
        _, _, db_r, db_i, ez_r, ez_i = _zoh(step, a_r, a_i)
        gb_r = tl.zeros((n,), tl.float32)  # g_dB = sum over the kernels of conj(C) g_C~
        gb_i = tl.zeros((n,), tl.float32)
        for k in tl.static_range(c):
            at = k * H * n + m
            c_r, c_i = tl.load(C + 2 * at), tl.load(C + 2 * at + 1)
            g_r, g_i = tl.load(g_cr + at), tl.load(g_ci + at)
            tl.store(d_C + 2 * at, db_r * g_r + db_i * g_i)  # conj(dB) g_C~
            tl.store(d_C + 2 * at + 1, db_r * g_i - db_i * g_r)
            gb_r += c_r * g_r + c_i * g_i
            gb_i += c_r * g_i - c_i * g_r
        norm = a_r * a_r + a_i * a_i
        h_r = tl.math.div_rn(a_r * gb_r - a_i * gb_i, norm)  # conj(1 / A) g_dB
        h_i = tl.math.div_rn(a_r * gb_i + a_i * gb_r, norm)
        gz_r = tl.load(g_ar + m) + ez_r * h_r + ez_i * h_i  # g_z = g_logdA + conj(exp(z)) h
        gz_i = tl.load(g_ai + m) + ez_r * h_i - ez_i * h_r
        # g_A = dt g_z - conj(dB) h; A's real part is -exp(log_A_real), whose derivative is itself
        tl.store(d_log_a + m, a_r * (step * gz_r - (db_r * h_r + db_i * h_i)))
        tl.store(d_a_imag + m, step * gz_i - (db_r * h_i - db_i * h_r))
        tl.store(d_log_dt + h, step * tl.sum(a_r * gz_r + a_i * gz_i, axis=0))  # g_dt, times d dt / d log_dt = dt


def discretize_warps(n: int) -> int:
    """Warps of a discretization program over n modes: a mode or two a thread (at N 256 in one warp, four a thread,
    the backward spills; tests/models/test_s4d_fused.py compiles both for sm_90 and checks)."""
    return max(1, min(4, n // 64))


@torch.library.custom_op(f"{_NS}::discretize", mutates_args=())
def _discretize_forward(log_dt: torch.Tensor, log_A_real: torch.Tensor, A_imag: torch.Tensor,
                        C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """log dA (H, n) and C~ (c, H, n) as real and imaginary parts, float32, for log_dt (H,), log_A_real and A_imag
    (H, n), C (c, H, n, 2)."""
    c, H, n, _ = C.shape
    outs = [torch.empty_like(log_A_real), torch.empty_like(log_A_real), C.new_empty(c, H, n), C.new_empty(c, H, n)]
    with _on(C):
        _discretize_forward_kernel[(H,)](log_dt, log_A_real, A_imag, C, *outs, H, n=n, c=c,
                                         num_warps=discretize_warps(n))
    return tuple(outs)


@_discretize_forward.register_fake
def _discretize_forward_fake(log_dt, log_A_real, A_imag, C):
    return (torch.empty_like(log_A_real), torch.empty_like(log_A_real), C.new_empty(C.shape[:-1]),
            C.new_empty(C.shape[:-1]))


@torch.library.custom_op(f"{_NS}::discretize_backward", mutates_args=())
def _discretize_backward(log_dt: torch.Tensor, log_A_real: torch.Tensor, A_imag: torch.Tensor, C: torch.Tensor,
                         g_ar: torch.Tensor, g_ai: torch.Tensor, g_cr: torch.Tensor, g_ci: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the four parameters, float32, in their shapes."""
    c, H, n, _ = C.shape
    grads = [torch.empty_like(p) for p in (log_dt, log_A_real, A_imag, C)]
    with _on(C):
        _discretize_backward_kernel[(H,)](log_dt, log_A_real, A_imag, C, g_ar, g_ai, g_cr, g_ci, *grads, H, n=n,
                                          c=c, num_warps=discretize_warps(n))
    return tuple(grads)


@_discretize_backward.register_fake
def _discretize_backward_fake(log_dt, log_A_real, A_imag, C, g_ar, g_ai, g_cr, g_ci):
    return tuple(torch.empty_like(p) for p in (log_dt, log_A_real, A_imag, C))


class _KernelDiscretize(torch.autograd.Function):
    """`s4d_chunked._Discretize` (ZOH) of `parameter_pairs` in one Triton launch each way."""

    @staticmethod
    def forward(ctx, log_dt, log_A_real, A_imag, C):
        params = [p.contiguous() for p in (log_dt, log_A_real, A_imag, C)]
        ctx.save_for_backward(*params)
        return _discretize_forward(*params)

    @staticmethod
    def backward(ctx, g_ar, g_ai, g_cr, g_ci):
        params = ctx.saved_tensors
        if torch.is_grad_enabled():  # a second derivative wanted (create_graph): the reference's graph gives it
            return tuple(discretize_through(params, (g_ar, g_ai, g_cr, g_ci), True, stored=True))
        return _discretize_backward(*params, *(g.contiguous() for g in (g_ar, g_ai, g_cr, g_ci)))
