"""Triton kernels for the eager `grouped_mm` MoE dispatch on CUDA (moe.py): the k-way sums of gathered rows, the
SwiGLU activation scaled by each row's routing weight, and the float32 router with the experts' cast of its input,
one kernel each way.

Hand-written because eager PyTorch spreads each over several generic kernels. Profiled on an H200 (one E 8, k 2
layer, 32,768 tokens, d_model 2,048, experts 768 wide, bf16; bench/results/2026-11-28-gpu-speed-NVIDIA-H200-e1664d1):
the k-way sums gather the pairs' rows into a `(k T, D)` tensor and reduce it over k (four gathers, 0.71 ms, and two
reductions over the outer dimension, 0.55 ms), and `silu(gate) * up * w` with its backward is about ten elementwise,
copy and cat kernels (about 1.2 ms) over `(R, 2F)` tensors, each a pass over memory: together about a third of the
layer's 7.3 ms of kernels. Here each sum reads every gathered row once and writes each token's row once, and the
activation reads the gate and up halves once each way. Both compute in float32 and round once to the output's dtype
(PyTorch rounds `silu(gate)`, the product and the weight each to bf16).

The router stays float32 under autocast (its softmax decides the routing), and its input is the model's float32
residual stream: in the same profile its three matmuls, with 8 outputs, ran as CUDA-core kernels (0.38 ms, where one
pass over x takes about 0.08 ms); the experts read x again to cast it to bf16; and x's gradient is the router's
float32 one plus the experts' bf16 one cast up, two more passes over `(T, D)` float32. `route_and_cast` reads x once
for the logits and the cast, and writes x's whole gradient in one pass with W's: by the passes it saves, about
0.5 ms of that layer, if its CUDA-core products keep pace with memory (an estimate, until a GPU times it).

Inside `torch.compile` inductor fuses these operations itself, so compiled layers keep PyTorch's operators;
Triton's interpreter (`TRITON_INTERPRET=1`) runs the kernels on CPU tensors for the tests.

Notation as in moe.py: `T` tokens of width `D`, `k` pairs a token, `R` rows of the static layout, `F` experts'
hidden width, `E` experts; `h (R, 2F)` is the first grouped matmul's output, `(gate | up)`; `W (E, D)` the
router's weight.
"""

import contextlib

import torch

from .kernel_trials import kernels_fail

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


    @triton.jit
    def _route_cast_forward_kernel(x, w, logits, xc, T, D, E, EP: tl.constexpr, BLOCK_T: tl.constexpr,
                                   BLOCK_D: tl.constexpr):
        """logits[t] = W x[t] (T, E) with IEEE float32 products, and xc = x rounded to xc's dtype, from one read of
        x (T, D) float32; W (E, D) float32, E padded to EP rows (zeros) for `tl.dot`."""
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.arange(0, EP)
        in_t, in_e = t < T, e < E
        acc = tl.zeros((BLOCK_T, EP), dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            in_d = d < D
            mask = in_t[:, None] & in_d[None, :]
            xt = tl.load(x + t[:, None] * D + d[None, :], mask=mask, other=0.0)  # (BLOCK_T, BLOCK_D)
            tl.store(xc + t[:, None] * D + d[None, :], xt.to(xc.dtype.element_ty), mask=mask)
            wt = tl.load(w + e[:, None] * D + d[None, :], mask=in_e[:, None] & in_d[None, :], other=0.0)  # (EP, BD)
            acc = tl.dot(xt, tl.trans(wt), acc=acc, input_precision="ieee")
        tl.store(logits + t[:, None] * E + e[None, :], acc, mask=in_t[:, None] & in_e[None, :])

    @triton.jit
    def _route_cast_backward_kernel(gl, gc, x, w, dx, dw_part, T, D, E, EP: tl.constexpr, BLOCK_T: tl.constexpr,
                                    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, X_GRAD: tl.constexpr = True,
                                    W_GRAD: tl.constexpr = True):
        """dx = gc + gl W (T, D) float32, from the logits' gradient gl (T, E) float32 and the cast's gc (T, D); and
        the share of W's gradient, gl^T x, of this program's ROWS rows, into its slice of dw_part (blocks, E, D)
        float32 (one slice per ROWS rows: the partial sums stay a small fraction of x). `X_GRAD`, `W_GRAD`: which of
        the two to make (a frozen router, as in a LoRA fine-tune, needs no W gradient)."""
        blk = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        e = tl.arange(0, EP)
        in_d, in_e = d < D, e < E
        wt = tl.load(w + e[:, None] * D + d[None, :], mask=in_e[:, None] & in_d[None, :], other=0.0)  # (EP, BD)
        part = tl.zeros((EP, BLOCK_D), dtype=tl.float32)
        for start in range(0, ROWS, BLOCK_T):
            t = blk * ROWS + start + tl.arange(0, BLOCK_T)
            in_t = t < T
            g = tl.load(gl + t[:, None] * E + e[None, :], mask=in_t[:, None] & in_e[None, :], other=0.0)  # (BT, EP)
            mask = in_t[:, None] & in_d[None, :]
            at = t[:, None] * D + d[None, :]
            if X_GRAD:
                grad = tl.load(gc + at, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx + at, tl.dot(g, wt, acc=grad, input_precision="ieee"), mask=mask)
            if W_GRAD:
                xt = tl.load(x + at, mask=mask, other=0.0)
                part = tl.dot(tl.trans(g), xt, acc=part, input_precision="ieee")  # masked rows are zeros
        if W_GRAD:
            tl.store(dw_part + blk * E * D + e[:, None] * D + d[None, :], part, mask=in_e[:, None] & in_d[None, :])


# (rows, columns, warps) a program, 16 values a thread. Built for sm_90 (tests/models/test_moe_kernels.py), none
# spills; the activation's backward keeps five values an element live (and a 64-bit address for each of its five
# tensors), so it takes 8 rows where the forward takes 16: 152 and 72 registers a thread in bfloat16. Untuned: the
# GPU timing (bench/gpu_speed.py, `moe_layer`) compares the layer with PyTorch's operators.
PAIR_SUMS_BLOCK = (8, 256, 4)
# Both ways; the forward walks every column of its rows, a backward program ROUTER_GRAD_ROWS rows of its columns.
# `tl.dot` in IEEE float32 runs on CUDA cores and holds its operands in registers: at 32 rows the forward spilled.
ROUTE_CAST_BLOCK = (16, 64, 8)
ROUTER_GRAD_ROWS = 256
# The most experts `route_and_cast` takes (0: never). Its IEEE float32 products run on CUDA cores and grow with E,
# while the memory it saves does not; at 32 its sm_90 builds still spill nothing.
ROUTER_MAX_EXPERTS = 32
SWIGLU_BLOCK = {"forward": (16, 128, 4), "backward": (8, 256, 4)}  # the backward walks every column of its rows


def _moe_kernels_on(x: torch.Tensor) -> bool:
    """As `MOE_KERNELS` says for `x`, with Triton installed, outside `torch.compile`, below float64 (they compute in
    float32; float64 is for reference checks)."""
    if triton is None or torch.compiler.is_compiling() or x.dtype == torch.float64:
        return False
    return MOE_KERNELS == "always" or MOE_KERNELS == "cuda" and x.is_cuda


def moe_kernels_run(x: torch.Tensor) -> bool:
    """Whether the eager layer takes the sums and activation kernels for `x`: where `MOE_KERNELS` says and they
    build and run on this GPU (`kernels_fail`: tried once, in x's dtype)."""
    return _moe_kernels_on(x) and not kernels_fail(
        "The MoE layer's sum and activation kernels", "MoE layers take PyTorch's operators for them", (x.dtype,),
        lambda device: _moe_sums_trial(device, x.dtype))


def _moe_sums_trial(device: torch.device, dtype: torch.dtype) -> None:
    """`swiglu_weighted` forward and backward, and `pair_sums`, on a few rows that fill no block."""
    h = torch.ones((40, 2 * 70), dtype=dtype, device=device, requires_grad=True)
    act = swiglu_weighted(h, torch.ones(40, device=device, requires_grad=True))  # (40, 70)
    act.float().sum().backward()
    pair_sums(act.detach(), torch.arange(40, device=device), 20)


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


class _RouteAndCast(torch.autograd.Function):
    """`x (T, D)` float32, `W (E, D)` float32 -> `(x W^T (T, E) float32, x in dtype)`; backward: x's gradient, the
    cast's plus the logits', float32, and W's."""

    @staticmethod
    def forward(ctx, x, w, dtype):
        x, w = x.contiguous(), w.contiguous()
        ctx.save_for_backward(x, w)
        (T, D), E = x.shape, w.shape[0]
        logits, xc = x.new_empty((T, E)), x.new_empty((T, D), dtype=dtype)
        if T and D:
            bt, bd, warps = ROUTE_CAST_BLOCK
            with _moe_device(x):
                _route_cast_forward_kernel[(triton.cdiv(T, bt),)](x, w, logits, xc, T, D, E, EP=_padded(E),
                                                                  BLOCK_T=bt, BLOCK_D=bd, num_warps=warps)
        else:
            logits.zero_()
        return logits, xc

    @staticmethod
    def backward(ctx, g_logits, g_cast):
        x, w = ctx.saved_tensors
        x_grad, w_grad = ctx.needs_input_grad[:2]
        (T, D), E = x.shape, w.shape[0]
        bt, bd, warps = ROUTE_CAST_BLOCK
        nblk = triton.cdiv(T, ROUTER_GRAD_ROWS)
        dx = torch.empty_like(x) if x_grad else x.new_empty((1,))
        parts = x.new_empty((nblk, E, D) if w_grad else (1,))  # every slice written whole
        if T and D and (x_grad or w_grad):
            with _moe_device(x):
                _route_cast_backward_kernel[(nblk, triton.cdiv(D, bd))](
                    g_logits.contiguous().float(), g_cast.contiguous(), x, w, dx, parts, T, D, E, EP=_padded(E),
                    BLOCK_T=bt, BLOCK_D=bd, ROWS=ROUTER_GRAD_ROWS, X_GRAD=x_grad, W_GRAD=w_grad, num_warps=warps)
        return dx if x_grad else None, parts.sum(0) if w_grad else None, None


def _padded(E: int) -> int:
    """The experts' rows as `tl.dot` takes them: a power of two of at least 16."""
    return max(16, triton.next_power_of_2(E))


def router_kernel_takes(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `route_and_cast` runs for `x (T, D)` and the router's `w (E, D)` with experts in `dtype`: float32 x
    and router (the residual stream and master weights of a model under autocast), a half-precision `dtype`, at most
    `ROUTER_MAX_EXPERTS` experts, where these kernels run."""
    if not (_moe_kernels_on(x) and x.dtype == w.dtype == torch.float32 and x.dim() == 2
            and dtype in (torch.bfloat16, torch.float16) and w.shape[0] <= ROUTER_MAX_EXPERTS):
        return False
    E = _padded(w.shape[0])
    return not kernels_fail("The MoE router's kernels", "MoE layers take PyTorch's router", (dtype, E),
                            lambda device: _moe_router_trial(device, dtype, E))


def _moe_router_trial(device: torch.device, dtype: torch.dtype, E: int) -> None:
    """`route_and_cast` forward and backward with E experts (its padded count) on a few rows that fill no block."""
    x = torch.ones((40, 70), device=device, requires_grad=True)
    w = torch.ones((E, 70), device=device, requires_grad=True)
    logits, xc = route_and_cast(x, w, dtype)
    (logits.sum() + xc.float().sum()).backward()


def route_and_cast(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits `x W^T (T, E)` in float32 (IEEE products, as PyTorch's float32 matmul without TF32) and
    `x` rounded to the experts' `dtype`, from one read of `x`; backward in one pass too: x's float32 gradient is the
    cast's (the experts') plus the router's, each token's from its own rows alone, and W's is summed per block of
    rows, then over the blocks (no atomics: the same sum every run)."""
    return _RouteAndCast.apply(x, w, dtype)
