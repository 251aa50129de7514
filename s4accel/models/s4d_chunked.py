"""The S4D convolution in chunked form: batched matrix products instead of FFTs, for GPUs.

A diagonal SSM's kernel is a sum of exponentials, `K[l] = 2 Re(sum_n C~_n dA_n^l)`, so the causal convolution
`y = K * u + D u` splits exactly at chunk borders (Mamba-2's SSD does the same for its scalar-A SSM). Cut the
sequence into `nc` chunks of `T` steps; for position `i` of chunk `c`:

    y[c, i] = sum_{j <= i} K[i - j] u[c, j] + D u[c, i]          within the chunk: a T x T Toeplitz matrix per channel
            + 2 Re(sum_n C~_n dA_n^(i+1) X_c[n])                 what the earlier chunks left in the state
    S_c[n]  = sum_j dA_n^(T-1-j) u[c, j]                          the state chunk c leaves, started from zero
    X_c     = sum_{c' < c} (dA_n^T)^(c-1-c') S_c'[n]              the state entering chunk c

Each line is a batched matmul over the `H` channels with the `B * nc` chunks as rows: three of `(B nc) x T` by
`T x T` or `T x N`, plus one `nc x nc` product per (channel, mode) for the scan across chunks. Nothing of size
`(B, H, N, L)` is built, the matrices are made once per forward from the `(H, N/2)` parameters, and with a half
precision operand dtype the three large products run on tensor cores (float32 accumulation). The FLOPs per element
of `u` are `2 (T + 2 N)` against an FFT's few hundred, but they are tensor-core FLOPs and the bytes moved are a few
passes over `u`: on a GPU that is what counts.

Everything is real arithmetic on (real, imaginary) pairs, so `torch.compile`'s inductor generates code for all of it
(it has no code generation for complex tensors) and NCCL could carry any of it.

Precision: in float64 and float32 this equals the FFT convolution to rounding (tests: 1e-12 and 1e-5 against the
float64 reference). With `dtype=torch.bfloat16` the inputs, the Toeplitz taps, `dA` powers and states are rounded to
bfloat16 for the products (accumulated in float32) and the scan across chunks runs in float32: the output is
within about 1e-2 (relative to its largest value) of the float64 reference, as a bfloat16 matmul is (tests check it).

The slow, obviously correct references beside it: `fft_conv` of the kernel, and the kernel's step-by-step
`recurrence` (tests/models/test_s4d_chunked.py checks this against both, values and gradients, in every dtype). The
discretization and the matrices are each one autograd node with a hand-written backward, so that eager PyTorch
launches few kernels for them; `reference_discretize_pairs` and `reference_matrices` are the same under plain
autograd (checked against each other, and against finite differences).

Under `torch.compile`, torch 2.11 (fixed in 2.12: pytorch/pytorch#180642) sends the gradient of an
autograd.Function's output to the wrong place when the forward returns a tensor that its graph also holds as an
intermediate: `t` after `t.contiguous()` of an already contiguous `t` (the same tensor), or a buffer after an
in-place copy into it. The compiled step then gave the kernel's taps, D with them, no gradient
(tests/models/test_s4d_chunked.py checks each path's compiled gradients; `make test-floor` runs those tests on torch
2.11, our floor). So no forward here returns such a tensor under `torch.compile`: each output is made by its
last operation (eager, the layouts are copied into fresh buffers, by a Triton kernel on CUDA).

Copied into Hub repositories with `modeling_s4.py`: it imports only torch.
"""

import contextlib

import torch

from .kernel_trials import kernels_fail


def powers(log_dA: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`dA^k = exp(k log dA)` as (real, imaginary) for `log_dA` pairs `(H, n)` and exponents `k (m,)` -> `(H, n, m)`.
    One exponential of an exact multiple of `log dA` per power, so rounding does not grow with `k`."""
    ar, ai = log_dA
    magnitude = torch.exp(ar[..., None] * k)
    angle = ai[..., None] * k
    return magnitude * torch.cos(angle), magnitude * torch.sin(angle)


def fp32_or_wider(t: torch.Tensor) -> torch.Tensor:
    """float64 stays float64 (for reference checks); anything narrower is computed in float32."""
    return t if t.dtype == torch.float64 else t.float()


def parameter_pairs(log_dt: torch.Tensor, log_A_real: torch.Tensor, A_imag: torch.Tensor, C: torch.Tensor,
                    copies: int = 1):
    """S4D's parameters as stored -> what `discretize_pairs` reads: `dt = exp(log_dt)` (H, 1), `A = -exp(log_A_real)
    + i A_imag` as a pair (H, n) (each SSM's modes repeated over its `copies` channels) and `C (c, H, n, 2)` split into
    its (real, imaginary) halves (c, H, n); `fp32_or_wider`."""
    def per_channel(t):
        return t.repeat_interleave(copies, dim=0) if copies > 1 else t
    C = fp32_or_wider(C)
    A = per_channel(-torch.exp(fp32_or_wider(log_A_real))), per_channel(fp32_or_wider(A_imag))
    return torch.exp(fp32_or_wider(log_dt))[:, None], A, (C[..., 0], C[..., 1])


def discretize_pairs(dt: torch.Tensor, A: tuple, C: tuple, zoh: bool):
    """S4D's discretization in real arithmetic: `dt (H, 1)`, `A (H, n)` and `C (c, H, n)` as (real, imaginary)
    pairs -> `log dA (H, n)` and `C~ = C dB (c, H, n)` as pairs. ZOH: `log dA = dt A`, `dB = (exp(dt A) - 1) / A`;
    bilinear: `dA = (1 + dt A/2) / (1 - dt A/2)`, `dB = dt / (1 - dt A/2)`. One autograd node with the chain rule
    written out (`_Discretize`); `reference_discretize_pairs` is the same under plain autograd."""
    ar, ai, cr, ci = _Discretize.apply(dt, *A, *C, zoh)
    return (ar, ai), (cr, ci)


def reference_discretize_pairs(dt: torch.Tensor, A: tuple, C: tuple, zoh: bool):
    """`discretize_pairs` written plainly under autograd: the slow, obviously correct reference."""
    log_dA, (dBr, dBi), _ = _log_dA_dB(dt, *A, zoh)
    Cr, Ci = C
    return log_dA, (Cr * dBr - Ci * dBi, Cr * dBi + Ci * dBr)


def _log_dA_dB(dt, Ar, Ai, zoh: bool):
    """`log dA`, `dB` and (ZOH) `exp(dt A)` as pairs `(H, n)` (see `discretize_pairs`)."""
    ar, ai = dt * Ar, dt * Ai  # dt A
    if zoh:  # log dA = dt A; dB = (exp(dt A) - 1) / A
        cos, e, half = torch.cos(ai), torch.exp(ar), torch.sin(ai / 2)
        # Re(exp(dt A) - 1) without cancelling for small dt A: expm1, and cos - 1 as -2 sin^2(dt A_imag / 2)
        num_r = torch.expm1(ar) * cos - 2 * half * half
        num_i = e * torch.sin(ai)
        norm = Ar * Ar + Ai * Ai
        return (ar, ai), ((num_r * Ar + num_i * Ai) / norm, (num_i * Ar - num_r * Ai) / norm), (e * cos, num_i)
    # bilinear: dA = (1 + dt A/2) / (1 - dt A/2), dB = dt / (1 - dt A/2)
    pr, pi, qr, qi = 1 + ar / 2, ai / 2, 1 - ar / 2, -ai / 2
    q2 = qr * qr + qi * qi
    log_dA = (0.5 * (torch.log(pr * pr + pi * pi) - torch.log(q2)),
              torch.atan2(pi, pr) - torch.atan2(qi, qr))  # log|dA|, arg dA (any branch: integer powers)
    return log_dA, (dt * qr / q2, -dt * qi / q2), None


class _Discretize(torch.autograd.Function):
    """`reference_discretize_pairs` as one autograd node: the same forward (bit for bit), and a backward of fewer
    operations (each a kernel launch on a GPU; see `_Matrices`).

    With `z = dt A` and gradients written as complex numbers `g = dL/dRe + i dL/dIm`, a holomorphic `w = f(u)` passes
    `g_u = conj(f'(u)) g_w`. So `g_C = conj(dB) g_C~`, `g_dB = sum_c conj(C) g_C~`, and
      ZOH:      g_z = g_logdA + conj(exp(z) / A) g_dB,                  g_A = dt g_z - conj(dB / A) g_dB
      bilinear: g_z = conj(1 / (p q)) g_logdA + conj(dB / (2 q)) g_dB,   g_A = dt g_z        (p, q = 1 +- z/2)
    and `g_dt = sum_n Re(conj(A) g_z)`, plus `Re(conj(1 / q) g_dB)` for bilinear, whose dB reads dt itself."""

    @staticmethod
    def forward(ctx, dt, Ar, Ai, Cr, Ci, zoh: bool):
        (ar, ai), (dBr, dBi), ez = _log_dA_dB(dt, Ar, Ai, zoh)
        ctx.zoh = zoh
        ctx.save_for_backward(dt, Ar, Ai, Cr, Ci, dBr, dBi, *(ez or ()))
        return ar, ai, *_mul((Cr, Ci), (dBr, dBi))

    @staticmethod
    def backward(ctx, g_ar, g_ai, g_cr, g_ci):
        dt, Ar, Ai, Cr, Ci, dBr, dBi, *ez = ctx.saved_tensors
        if torch.is_grad_enabled():  # a second derivative wanted (create_graph): the reference's graph gives it
            return *discretize_through((dt, Ar, Ai, Cr, Ci), (g_ar, g_ai, g_cr, g_ci), ctx.zoh), None
        g_Cr, g_Ci = _mul_conj((dBr, dBi), (g_cr, g_ci))
        gB = tuple(g.sum(0) for g in _mul_conj((Cr, Ci), (g_cr, g_ci)))  # conj(C) g_C~, over the c kernels
        if ctx.zoh:
            norm = Ar * Ar + Ai * Ai
            h = _mul_conj((Ar / norm, -Ai / norm), gB)  # conj(1 / A) g_dB
            t, s = _mul_conj(ez, h), _mul_conj((dBr, dBi), h)
            gz = (g_ar + t[0], g_ai + t[1])
            gAr, gAi = dt * gz[0] - s[0], dt * gz[1] - s[1]
            g_dt = (Ar * gz[0] + Ai * gz[1]).sum(-1, keepdim=True)
        else:
            ar, ai = dt * Ar, dt * Ai
            q = (1 - ar / 2, -ai / 2)
            dlog = _inverse(_mul((1 + ar / 2, ai / 2), q))  # d log dA / dz = 1 / (p q)
            inv_q = _inverse(q)
            u, t = _mul_conj(dlog, (g_ar, g_ai)), _mul_conj(_mul((dBr / 2, dBi / 2), inv_q), gB)  # dB / (2 q)
            gz = (u[0] + t[0], u[1] + t[1])
            gAr, gAi = dt * gz[0], dt * gz[1]
            g_dt = (Ar * gz[0] + Ai * gz[1] + inv_q[0] * gB[0] + inv_q[1] * gB[1]).sum(-1, keepdim=True)
        return g_dt, gAr, gAi, g_Cr, g_Ci, None


def _through(reference, inputs: tuple, grads: tuple) -> list:
    """The gradients of `reference(*inputs)` for the output gradients `grads`, themselves differentiable: a node's
    backward under `create_graph`. The hand-written backwards read tensors their forward saved outside the graph, so
    a gradient of their gradient would miss those paths; the reference's graph has them all. None for an input that
    needs no gradient."""
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    with torch.enable_grad():
        got = torch.autograd.grad(reference(*inputs), [inputs[i] for i in wanted], grads, create_graph=True,
                                  allow_unused=True)
    out = [None] * len(inputs)
    for i, g in zip(wanted, got):
        out[i] = g
    return out


def discretize_through(inputs: tuple, grads: tuple, zoh: bool, stored: bool = False) -> list:
    """`_through` for the discretization: the gradients of (dt, Ar, Ai, Cr, Ci), or with `stored` of the parameters
    as stored (log_dt, log_A_real, A_imag, C: `parameter_pairs`), by `reference_discretize_pairs`."""
    def reference(*a):
        dt, A, C = parameter_pairs(*a) if stored else (a[0], a[1:3], a[3:])
        return [t for pair in reference_discretize_pairs(dt, A, C, zoh) for t in pair]
    return _through(reference, inputs, grads)


def matrices_through(inputs: tuple, grads: tuple, T: int, shift: int) -> list:
    """`_through` for the matrices: the gradients of (ar, ai, cr, ci, D or None) by `reference_matrices`."""
    with_D = inputs[4] is not None
    got = _through(lambda *a: reference_matrices(a[:2], a[2:4], a[4] if with_D else None, T, shift),
                   inputs[:4] + ((inputs[4],) if with_D else ()), grads)
    return [*got[:4], got[4] if with_D else None]


def _mul(a: tuple, b: tuple) -> tuple:
    """a b for complex numbers as real pairs."""
    return a[0] * b[0] - a[1] * b[1], a[0] * b[1] + a[1] * b[0]


def _mul_conj(a: tuple, b: tuple) -> tuple:
    """conj(a) b for complex numbers as real pairs."""
    return a[0] * b[0] + a[1] * b[1], a[0] * b[1] - a[1] * b[0]


def _inverse(a: tuple) -> tuple:
    """1 / a for a complex number as a real pair."""
    norm = a[0] * a[0] + a[1] * a[1]
    return a[0] / norm, -a[1] / norm


def chunk_matrices(log_dA, C_tilde, D, T: int, nc: int, shift: int = 0):
    """The per-channel matrices of the chunked convolution, in the parameters' dtype (float32 or float64).

    log_dA, C_tilde: `(H, n)` (real, imaginary) pairs; D `(H,)` or None; `shift` 0: `y[t]` reads `u[s]`, s <= t, with
    tap `K[t - s]`; 1: strictly causal, `u[s]` for s < t with tap `K[t - s - 1]` (the anti-causal half of a
    bidirectional layer, on the reversed sequence). Returns, with `N = 2n` real rows for `n` complex modes
    (interleaved real, imaginary):
        taps (H, T - shift)      K[0 .. T-1-shift] (plus D at lag 0), the Toeplitz matrix's
                                 `[j, i] = taps[i - j - shift]` for i - j >= shift, else 0 (`toeplitz`)
        to_state (H, N, T)       [(m, re/im), j] = dA_m^(T-1-j)
        scan (H, n, nc, 2 nc)    [c', c] = (dA^T)^(c-1-c') for c' < c, else 0; real parts, then imaginary parts
        from_state (H, N, T)     [(m, re), i] = 2 Re(Q), [(m, im), i] = -2 Im(Q), Q = C~_m dA_m^(i+1-shift)
    The first, second and fourth come from `matrices` (one autograd node); the scan from `powers`.
    """
    if nc == 1:  # the taps alone
        return reference_matrices(log_dA, C_tilde, D, T, shift, taps_only=True), None, None, None
    taps, to_state, from_state, _ = matrices(log_dA, C_tilde, D, T, shift)
    # the scan: (dA^T)^(c - 1 - c') strictly above the diagonal, a Toeplitz matrix of the powers of dA^T too
    ar = log_dA[0]
    gr, gi = powers(log_dA, T * torch.arange(nc - 1, device=ar.device, dtype=ar.dtype))  # (H, n, nc - 1)
    scan = torch.cat([_toeplitz(gr, 1), _toeplitz(gi, 1)], dim=-1)  # (H, n, nc, 2 nc)
    return taps, to_state, scan, from_state


def matrices(log_dA, C_tilde, D, T: int, shift: int = 0):
    """`chunk_matrices`' taps, to_state and from_state, and `dA^T` as `step (H, n, 2)` (real, imaginary), with
    a hand-written backward (`_Matrices`); `reference_matrices` is the same under plain autograd."""
    ar, ai = log_dA
    cr, ci = C_tilde
    return _Matrices.apply(ar, ai, cr, ci, D, T, shift)


def reference_matrices(log_dA, C_tilde, D, T: int, shift: int = 0, taps_only: bool = False):
    """`matrices` written plainly under autograd: the slow, obviously correct reference its tests compare with.
    `taps_only`: the taps alone (a sequence of one chunk needs nothing else)."""
    ar, ai = log_dA
    cr, ci = C_tilde
    H, n = ar.shape
    steps = torch.arange(T + 1, device=ar.device, dtype=ar.dtype)
    pr, pi = powers(log_dA, steps)  # dA^0 .. dA^T: (H, n, T + 1)
    taps = 2 * (torch.einsum("hn,hnl->hl", cr, pr[..., :T]) - torch.einsum("hn,hnl->hl", ci, pi[..., :T]))  # (H, T)
    if D is not None:  # the skip is the tap at lag 0
        taps = torch.cat([taps[:, :1] + D[:, None], taps[:, 1:]], dim=-1)
    taps = taps[:, :T - shift]
    if taps_only:
        return taps
    # slices and flips rather than index lists: their backward is a copy, not an index_put with accumulation
    to_state = torch.stack([pr[..., :T].flip(-1), pi[..., :T].flip(-1)], dim=2).reshape(H, 2 * n, T)  # dA^(T-1-j)
    er, ei = pr[..., 1 - shift: T + 1 - shift], pi[..., 1 - shift: T + 1 - shift]  # dA^(i + 1 - shift)
    qr = cr[..., None] * er - ci[..., None] * ei
    qi = cr[..., None] * ei + ci[..., None] * er
    from_state = torch.stack([2 * qr, -2 * qi], dim=2).reshape(H, 2 * n, T)
    return taps, to_state, from_state, torch.stack([pr[..., T], pi[..., T]], dim=-1)


class _Matrices(torch.autograd.Function):
    """`reference_matrices` as one autograd node. Eager PyTorch launches a kernel for every operation, and the kernel's
    generation is about 200 operations a layer under plain autograd (the discretization and these matrices, forward
    and backward), all on tiny `(H, N)` tensors: with a small model or short sequences the host launching them, not
    the GPU, sets the layer's pace (bench/launches.py counts them). Here the forward is 24 operations and the
    backward 38 (against 27 and 65), from the powers `P = dA^t, t = 0..T` and `Q = C~ P` (both `(H, n, T + 1)`), with
    the chain rule written out below; under `create_graph` (a second derivative) the backward takes the reference's
    graph instead (`_through`). `torch.compile` traces both like any other code."""

    @staticmethod
    def forward(ctx, ar, ai, cr, ci, D, T: int, shift: int):
        H, n = ar.shape
        t = torch.arange(T + 1, device=ar.device, dtype=ar.dtype)
        pr, pi = powers((ar, ai), t)  # (H, n, T + 1)
        C = (cr[..., None], ci[..., None])
        qr, qi = _mul(C, (pr, pi))  # Q = C~ P
        taps = 2 * qr[..., :T].sum(1)  # (H, T): K[l] = 2 Re(sum_m Q[m, l])
        if D is not None:
            taps[:, 0].add_(D)  # add_ on the view: `+=` on an index would copy it back again
        to_state = torch.stack([pr[..., :T].flip(-1), pi[..., :T].flip(-1)], dim=2).view(H, 2 * n, T)
        inner = slice(1 - shift, T + 1 - shift)  # Q[i + 1 - shift]
        from_state = torch.stack([2 * qr[..., inner], -2 * qi[..., inner]], dim=2).view(H, 2 * n, T)
        ctx.save_for_backward(pr, pi, cr, ci, t, ar, ai, D)
        ctx.shift, ctx.with_D = shift, D is not None
        taps = taps[:, :T - shift].contiguous() if shift else taps  # (never `.contiguous()` of itself: module docs)
        return taps, to_state, from_state, torch.stack([pr[..., T], pi[..., T]], -1)

    @staticmethod
    def backward(ctx, g_taps, g_to, g_from, g_step):
        pr, pi, cr, ci, t, ar, ai, D = ctx.saved_tensors
        if torch.is_grad_enabled():  # a second derivative wanted (create_graph): the reference's graph gives it
            return *matrices_through((ar, ai, cr, ci, D if ctx.with_D else None), (g_taps, g_to, g_from, g_step),
                                     t.numel() - 1, ctx.shift), None, None
        H, n, T1 = pr.shape
        T, shift = T1 - 1, ctx.shift
        g_from, g_to = g_from.view(H, n, 2, T), g_to.view(H, n, 2, T)
        # dL/dQ (real, imaginary) from the taps and from_state, then through Q = C~ P
        dqr, dqi = pr.new_zeros(H, n, T1), pr.new_zeros(H, n, T1)
        dqr[..., :T - shift].add_(g_taps[:, None, :], alpha=2)  # add_ on views: `+=` would copy each back
        dqr[..., 1 - shift: T1 - shift].add_(g_from[:, :, 0], alpha=2)
        dqi[..., 1 - shift: T1 - shift].add_(g_from[:, :, 1], alpha=-2)
        d_cr, d_ci = (g.sum(-1) for g in _mul_conj((pr, pi), (dqr, dqi)))
        dpr, dpi = _mul_conj((cr[..., None], ci[..., None]), (dqr, dqi))
        # ... plus what reaches P directly: to_state (reversed), dA^T
        dpr[..., :T].add_(g_to[:, :, 0].flip(-1))
        dpi[..., :T].add_(g_to[:, :, 1].flip(-1))
        dpr[..., T].add_(g_step[..., 0])
        dpi[..., T].add_(g_step[..., 1])
        # P = exp(t (ar + i ai)): dP/d ar = t P, dP/d ai = i t P
        d_ar, d_ai = ((g * t).sum(-1) for g in _mul_conj((pr, pi), (dpr, dpi)))
        return d_ar, d_ai, d_cr, d_ci, g_taps[:, 0] if ctx.with_D else None, None, None


def _toeplitz(taps: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """`(..., m)` taps -> `(..., T, T)` with `[j, i] = taps[i - j - shift]` where `0 <= i - j - shift < m`, else 0
    (`T = m + shift`; shift 0 or 1): the windows of the taps behind T zeros, last window first."""
    T = taps.shape[-1] + shift
    padded = torch.cat([taps.new_zeros(*taps.shape[:-1], T), taps], dim=-1)  # [p] = taps[p - T]
    windows = padded.unfold(-1, T, 1)  # (..., m + 1, T): window k holds [i] = taps[k + i - T]
    return windows[..., 1 - shift: T + 1 - shift, :].flip(-2)  # row j: window T - shift - j


class _Toeplitz(torch.autograd.Function):
    """`taps (H, m)` -> the Toeplitz matrices `(H, T, T)` (`_toeplitz`) built directly in `dtype`; the backward sums
    the gradient along each diagonal in float32 or wider (a padded copy read as a strided view), rather than through the
    flip, slice and unfold of the float32 construction (several passes over an (H, T, T) tensor, as large as a
    (64, 1024, 768) activation at T = 256)."""

    @staticmethod
    def forward(ctx, taps, shift: int, dtype):
        ctx.shift, ctx.m = shift, taps.shape[-1]
        ctx.dtype = taps.dtype
        return _toeplitz(taps.to(dtype), shift)  # (flip's result: a fresh, contiguous tensor)

    @staticmethod
    def backward(ctx, G):
        H, T, _ = G.shape
        padded = torch.nn.functional.pad(G.contiguous(), (0, T))  # (H, T, 2T): [j, e] below reads [j, j + e]
        wide = torch.float64 if G.dtype == torch.float64 else torch.float32
        diagonals = padded.as_strided((H, T, T), (2 * T * T, 2 * T + 1, 1)).sum(1, dtype=wide)
        return diagonals[:, ctx.shift: ctx.shift + ctx.m].to(ctx.dtype), None, None


def toeplitz(taps: torch.Tensor, shift: int, dtype: torch.dtype) -> torch.Tensor:
    """`(H, m)` taps -> `(H, T, T)` in `dtype` with `[j, i] = taps[i - j - shift]` (see `_toeplitz`)."""
    return _Toeplitz.apply(taps, shift, dtype)


def conv_channels_first(x: torch.Tensor, taps, to_state, scan, from_state, nc: int, shift: int = 0) -> torch.Tensor:
    """The chunked convolution on `x (H, B, nc T)` (channels first, zero-padded past the sequence) -> `(H, B, nc T)`
    in x's dtype, from `chunk_matrices`' outputs. The products read and write x's dtype; the scan across chunks runs
    in the matrices' dtype (float32, or float64)."""
    H, B, Lp = x.shape
    T, dtype, wide = Lp // nc, x.dtype, taps.dtype
    xm = x.view(H, B * nc, T)  # (H, M, T), M = B nc chunks
    y = torch.bmm(xm, toeplitz(taps, shift, dtype))  # within each chunk: (H, M, T)
    if nc > 1:
        n = to_state.shape[1] // 2
        S = torch.bmm(to_state.to(dtype), xm.transpose(1, 2))  # (H, N, M): each chunk's own end state
        S = S.to(wide).view(H * n, 2 * B, nc)  # per (channel, mode): rows [Re S over b; Im S over b], chunks
        Z = torch.bmm(S, scan.reshape(H * n, nc, 2 * nc))  # (H n, 2B, 2nc): [[Re S Re G, Re S Im G], [Im S ...]]
        X = torch.stack([Z[:, :B, :nc] - Z[:, B:, nc:], Z[:, :B, nc:] + Z[:, B:, :nc]], dim=1)  # entering states
        X = X.to(dtype).view(H, 2 * n, B * nc)  # (H, N, M), rows as to_state's
        y = torch.baddbmm(y, X.transpose(1, 2), from_state.to(dtype))  # what they add: (H, M, T)
    return y.view(H, B, Lp)


def chunked_conv(u: torch.Tensor, log_dA, C_tilde, D: torch.Tensor | None, T: int, dtype: torch.dtype,
                 shift: int = 0) -> torch.Tensor:
    """`y = K * u (+ D u)` for `u (B, L, H)` -> `y (B, L, H)` in `dtype`, by chunks of `T` steps (see the module
    docs; `shift` as in `chunk_matrices`): `conv_channels_first` between two transposes. The products read and write
    `dtype`; the matrices are made in the parameters' dtype, and the scan across chunks runs in float32 (or float64)
    whatever `dtype` is."""
    B, L, H = u.shape
    nc = -(-L // T)
    x = to_channels_first(u, dtype, nc * T)  # zero-padded at the end: a causal output never reads what follows it
    y = conv_channels_first(x, *chunk_matrices(log_dA, C_tilde, D, T, nc, shift), nc=nc, shift=shift)
    return from_channels_first(y, L)


# ----------------------------------------------------------------------------------------------------------------
# Layouts. The batched products want each channel's steps contiguous, (H, B, L); the model's tensors are (B, L, H).
# PyTorch copies a permuted tensor with its generic strided kernel (measured at ~0.6 TB/s on an H200 for the (B, L, H)
# -> (H, B, L) transpose, against ~3 TB/s for a plain copy), so on CUDA the transposes are a tiled Triton kernel
# (Triton comes with PyTorch's CUDA builds); elsewhere, and inside `torch.compile` (inductor tiles its own), they are
# PyTorch's copy.

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch: the CPU path is PyTorch's copy anyway
    triton = None

if triton is not None:
    @triton.jit
    def _transpose_kernel(src, dst, R, C, sb, sr, sc, db, dc, dr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """dst[b, c, r] = src[b, r, c], cast to dst's dtype: one (BLOCK_R, BLOCK_C) tile per program."""
        b = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < R) & (c[None, :] < C)
        x = tl.load(src + b * sb + r[:, None] * sr + c[None, :] * sc, mask=mask)
        tl.store(dst + b * db + r[:, None] * dr + c[None, :] * dc, x.to(dst.dtype.element_ty), mask=mask)


def transpose_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """`dst[b, c, r] = src[b, r, c]` (with a cast): `src (b, r, c)` and `dst (b, c, r)` views of any strides."""
    if (triton is None or not src.is_cuda or torch.compiler.is_compiling()
            or kernels_fail("The S4 layer's transpose kernel", "S4 layers take PyTorch's copy", (src.dtype, dst.dtype),
                            lambda device: _transpose_trial(device, src.dtype, dst.dtype))):
        dst.copy_(src.transpose(1, 2))
        return
    _transpose(src, dst)


def _transpose_trial(device: torch.device, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    """The transpose kernel once, on tensors that fill no tile (`kernels_fail`'s trial)."""
    src = torch.ones((2, 70, 90), dtype=src_dtype, device=device)
    _transpose(src, torch.empty((2, 90, 70), dtype=dst_dtype, device=device))


def _transpose(src: torch.Tensor, dst: torch.Tensor) -> None:
    nb, R, C = src.shape
    grid = (triton.cdiv(R, 64), triton.cdiv(C, 64), nb)
    with _on_device(src):
        _transpose_kernel[grid](src, dst, R, C, *src.stride(), *dst.stride(), BLOCK_R=64, BLOCK_C=64, num_warps=4)


def _to_channels_first(u: torch.Tensor, dtype: torch.dtype, Lp: int) -> torch.Tensor:
    B, L, H = u.shape
    if torch.compiler.is_compiling():  # not `out` after copies into it (torch 2.11: see the module's docs)
        return torch.nn.functional.pad(u.permute(2, 0, 1).to(dtype), (0, Lp - L))  # (pad's result: fresh, contiguous)
    out = u.new_empty((H, B, Lp), dtype=dtype)
    if Lp > L:
        out[..., L:].zero_()
    transpose_into(u, out[..., :L].permute(1, 0, 2))  # [b, l, h] -> [b, h, l]
    return out


def _from_channels_first(y: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    H, B, _ = y.shape
    if torch.compiler.is_compiling():  # not `out` after a copy into it (torch 2.11: see the module's docs)
        return y[..., :L].permute(1, 2, 0).to(dtype).contiguous()
    out = y.new_empty((B, L, H), dtype=dtype)
    transpose_into(y[..., :L].permute(1, 0, 2), out)  # [b, h, l] -> [b, l, h]
    return out


class _ToChannelsFirst(torch.autograd.Function):
    """`u (B, L, H)` -> `(H, B, Lp)` in `dtype`, zeros past L; backward: the gradient back to (B, L, H) in u's dtype.
    One pass each way (the transpose and the cast together)."""

    @staticmethod
    def forward(ctx, u, dtype, Lp: int):
        ctx.L, ctx.dtype = u.shape[1], u.dtype
        return _to_channels_first(u, dtype, Lp)

    @staticmethod
    def backward(ctx, g):
        return _from_channels_first(g, ctx.L, ctx.dtype), None, None


class _FromChannelsFirst(torch.autograd.Function):
    """`y (H, B, Lp)` -> its first L steps as `(B, L, H)` in `dtype`; backward: to (H, B, Lp), zeros past L."""

    @staticmethod
    def forward(ctx, y, L: int, dtype):
        ctx.Lp, ctx.dtype = y.shape[2], y.dtype
        return _from_channels_first(y, L, dtype)

    @staticmethod
    def backward(ctx, g):
        return _to_channels_first(g, ctx.dtype, ctx.Lp), None, None


def to_channels_first(u: torch.Tensor, dtype: torch.dtype, Lp: int) -> torch.Tensor:
    """`(B, L, H)` -> `(H, B, Lp)` in `dtype`, zero-padded past L (differentiable)."""
    return _ToChannelsFirst.apply(u, dtype, Lp)


def from_channels_first(y: torch.Tensor, L: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`(H, B, Lp)` -> the first L steps as `(B, L, H)`, in `dtype` (default: y's) (differentiable)."""
    return _FromChannelsFirst.apply(y, L, dtype or y.dtype)


class _ProjectChannelsFirst(torch.autograd.Function):
    """A Linear layer read from the channels-first layout: `x (K, M)` -> `x^T W^T + b (M, J)` for `W (J, K)`, in
    `dtype`. The products take x transposed as it lies (a GEMM reads either orientation), and the backward writes
    x's gradient channels first too, `W^T g^T (K, M)`, so that neither direction transposes an activation (PyTorch's
    Linear on the transposed view would hand back a transposed gradient, which the activation's backward then reads
    with strided loads)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        x, w, out = _projection(x, weight, bias, dtype)
        ctx.save_for_backward(x, w)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        wide = torch.float64 if g.dtype == torch.float64 else torch.float32
        grad_b = None if ctx.dtypes[1] is None else g.sum(0, dtype=wide).to(ctx.dtypes[1])
        return *_projection_grads(x, w, g, ctx.dtypes[0]), grad_b, None


def _projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """x and the weight in `dtype`, and `x^T W^T + b (M, J)` from them."""
    x, w = x.to(dtype), weight.to(dtype)
    return x, w, torch.mm(x.t(), w.t()) if bias is None else torch.addmm(bias.to(dtype), x.t(), w.t())


def _projection_grads(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, weight_dtype: torch.dtype):
    """The gradients of x (K, M) and of the weight (J, K), in its dtype, from the output's `g (M, J)`."""
    return torch.mm(w.t(), g.t()), torch.mm(g.t(), x.t()).to(weight_dtype)


def project_channels_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           dtype: torch.dtype) -> torch.Tensor:
    """`x (K, M)` channels first -> `(M, J)`: `F.linear(x.T, weight, bias)` in `dtype`, without transposing x."""
    return _ProjectChannelsFirst.apply(x, weight, bias, dtype)


# The GLU after the projection, on CUDA outside `torch.compile`: PyTorch's `glu` and its backward run a generic
# strided kernel over the projection's (M, 2H) output (measured on an H200 at M 65,536, H 768, bfloat16: 0.16 ms
# forward and 0.22 ms backward, ~2 TB/s, then 0.08 ms more for the bias gradient's column sums: a fifth of the
# eager layer at L 1,024). Here one kernel each way: the forward reads the projection's halves once, the backward
# writes the projection's gradient and the column sums of each block of rows for the bias. Inside `torch.compile`
# inductor fuses the GLU itself, so compiled layers keep PyTorch's operators.

if triton is not None:
    @triton.jit
    def _glu_forward_kernel(z, y, M, H, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
        """y[r, c] = z[r, c] sigmoid(z[r, H + c]) for z (M, 2H), y (M, H), in float32, stored in y's dtype."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (r[:, None] < M) & (c[None, :] < H)
        at = r[:, None] * 2 * H + c[None, :]
        a = tl.load(z + at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(z + at + H, mask=mask, other=0.0).to(tl.float32)
        tl.store(y + r[:, None] * H + c[None, :], (a / (1.0 + tl.exp(-b))).to(y.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_backward_kernel(g, z, dz, partial, M, H, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                             SUMS: tl.constexpr):
        """dz = (g s, g a s (1 - s)) for s = sigmoid(b), (a, b) the halves of z; with SUMS, each block of rows'
        column sums of dz as stored (rounded to its dtype), float32, into its row of `partial (blocks, 2H)`."""
        blk = tl.program_id(0).to(tl.int64)
        r = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (r[:, None] < M) & (c[None, :] < H)
        at = r[:, None] * 2 * H + c[None, :]
        a = tl.load(z + at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(z + at + H, mask=mask, other=0.0).to(tl.float32)
        go = tl.load(g + r[:, None] * H + c[None, :], mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-b))
        da = (go * s).to(dz.dtype.element_ty)
        db = (go * a * s * (1.0 - s)).to(dz.dtype.element_ty)
        tl.store(dz + at, da, mask=mask)
        tl.store(dz + at + H, db, mask=mask)
        if SUMS:  # masked entries are zeros: they add nothing
            tl.store(partial + blk * 2 * H + c, tl.sum(da.to(tl.float32), axis=0), mask=c < H)
            tl.store(partial + blk * 2 * H + H + c, tl.sum(db.to(tl.float32), axis=0), mask=c < H)


# Rows, columns and warps per program of both GLU kernels: compiled for sm_90, 4 warps spill in the float32 backward
# (tests/models/test_s4d_fused.py builds them)
GLU_BLOCK = (32, 128, 8)


def _on_device(x: torch.Tensor):
    """Triton launches on x's CUDA device (nothing to set for the interpreter's CPU tensors)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _glu_forward(z: torch.Tensor) -> torch.Tensor:
    M, H = z.shape[0], z.shape[1] // 2
    y = z.new_empty((M, H))
    bm, bh, warps = GLU_BLOCK
    with _on_device(z):
        _glu_forward_kernel[(triton.cdiv(M, bm), triton.cdiv(H, bh))](z, y, M, H, BLOCK_M=bm, BLOCK_H=bh,
                                                                      num_warps=warps)
    return y


def _glu_backward(g: torch.Tensor, z: torch.Tensor, sums: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    M, H = g.shape
    bm, bh, warps = GLU_BLOCK
    dz = torch.empty_like(z)
    partial = torch.empty((triton.cdiv(M, bm), 2 * H) if sums else (1,), dtype=torch.float32, device=z.device)
    with _on_device(z):
        _glu_backward_kernel[(triton.cdiv(M, bm), triton.cdiv(H, bh))](g, z, dz, partial, M, H, BLOCK_M=bm,
                                                                       BLOCK_H=bh, SUMS=sums, num_warps=warps)
    return dz, (partial.sum(0) if sums else None)


class _ProjectGLUChannelsFirst(torch.autograd.Function):
    """`_ProjectChannelsFirst` followed by a GLU over its output's halves, the GLU in `_glu_forward`/`_glu_backward`:
    `x (K, M)` -> `(M, J/2)`. Saves x, the weight and the projection's output (as PyTorch's GLU would)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        x, w, z = _projection(x, weight, bias, dtype)  # z (M, J)
        ctx.save_for_backward(x, w, z)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return _glu_forward(z)

    @staticmethod
    def backward(ctx, g):
        x, w, z = ctx.saved_tensors
        dz, grad_b = _glu_backward(g.contiguous().to(z.dtype), z, ctx.dtypes[1] is not None)
        return *_projection_grads(x, w, dz, ctx.dtypes[0]), None if grad_b is None else grad_b.to(ctx.dtypes[1]), None


def glu_kernels_run(x: torch.Tensor) -> bool:
    """Whether `project_glu_channels_first` runs here: on CUDA with Triton, outside `torch.compile`, below float64
    (the kernels compute in float32), where the kernels build and run on this GPU (`kernels_fail`: tried once)."""
    return (triton is not None and x.is_cuda and x.dtype != torch.float64 and not torch.compiler.is_compiling()
            and not kernels_fail("The S4 layer's GLU kernels", "S4 layers take PyTorch's GLU", (x.dtype,),
                                 lambda device: _glu_trial(device, x.dtype)))


def _glu_trial(device: torch.device, dtype: torch.dtype) -> None:
    """Both GLU kernels once, on a `(M, 2H)` tensor that fills no block (`kernels_fail`'s trial)."""
    z = torch.ones((40, 2 * 130), dtype=dtype, device=device)
    _glu_forward(z)
    _glu_backward(torch.ones((40, 130), dtype=dtype, device=device), z, sums=True)


def project_glu_channels_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               dtype: torch.dtype) -> torch.Tensor:
    """`x (K, M)` channels first -> `(M, J/2)`: `F.glu(project_channels_first(x, weight, bias, dtype))` with the GLU
    in one Triton kernel each way (`glu_kernels_run` says where the layer takes it; Triton's interpreter runs it on
    CPU tensors for the tests)."""
    return _ProjectGLUChannelsFirst.apply(x.contiguous(), weight, bias, dtype)
