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
`recurrence` (tests/models/test_s4d_chunked.py checks this against both, values and gradients, in every dtype).

Copied into Hub repositories with `modeling_s4.py`: it imports only torch.
"""

import torch


def powers(log_dA: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`dA^k = exp(k log dA)` as (real, imaginary) for `log_dA` pairs `(H, n)` and exponents `k (m,)` -> `(H, n, m)`.
    One exponential of an exact multiple of `log dA` per power, so rounding does not grow with `k`."""
    ar, ai = log_dA
    magnitude = torch.exp(ar[..., None] * k)
    angle = ai[..., None] * k
    return magnitude * torch.cos(angle), magnitude * torch.sin(angle)


def chunk_matrices(log_dA, C_tilde, D, T: int, nc: int, shift: int = 0):
    """The per-channel matrices of the chunked convolution, in the parameters' dtype (float32 or float64).

    log_dA, C_tilde: `(H, n)` (real, imaginary) pairs; D `(H,)` or None; `shift` 0: `y[t]` reads `u[s]`, s <= t, with
    tap `K[t - s]`; 1: strictly causal, `u[s]` for s < t with tap `K[t - s - 1]` (the anti-causal half of a
    bidirectional layer, on the reversed sequence). Returns, with `N = 2n` real rows for `n` complex modes
    (interleaved real, imaginary):
        toeplitz (H, T, T)       [j, i] = K[i - j - shift] for i - j >= shift (plus D on the diagonal), else 0
        to_state (H, N, T)       [(m, re/im), j] = dA_m^(T-1-j)
        scan (H, n, nc, 2 nc)    [c', c] = (dA^T)^(c-1-c') for c' < c, else 0; real parts, then imaginary parts
        from_state (H, N, T)     [(m, re), i] = 2 Re(Q), [(m, im), i] = -2 Im(Q), Q = C~_m dA_m^(i+1-shift)
    """
    ar, ai = log_dA
    cr, ci = C_tilde
    H, n = ar.shape
    steps = torch.arange(T + 1, device=ar.device, dtype=ar.dtype)
    pr, pi = powers(log_dA, steps)  # dA^0 .. dA^T: (H, n, T + 1)
    taps = 2 * (torch.einsum("hn,hnl->hl", cr, pr[..., :T]) - torch.einsum("hn,hnl->hl", ci, pi[..., :T]))  # (H, T)
    if D is not None:  # the skip is the tap at lag 0
        taps = torch.cat([taps[:, :1] + D[:, None], taps[:, 1:]], dim=-1)
    toeplitz = _toeplitz(taps[:, :T - shift], shift)
    if nc == 1:
        return toeplitz, None, None, None
    # slices and flips rather than index lists: their backward is a copy, not an index_put with accumulation
    to_state = torch.stack([pr[..., :T].flip(-1), pi[..., :T].flip(-1)], dim=2).reshape(H, 2 * n, T)  # dA^(T-1-j)
    er, ei = pr[..., 1 - shift: T + 1 - shift], pi[..., 1 - shift: T + 1 - shift]  # dA^(i + 1 - shift)
    qr = cr[..., None] * er - ci[..., None] * ei
    qi = cr[..., None] * ei + ci[..., None] * er
    from_state = torch.stack([2 * qr, -2 * qi], dim=2).reshape(H, 2 * n, T)
    # the scan: (dA^T)^(c - 1 - c') strictly above the diagonal, a Toeplitz matrix of the powers of dA^T too
    gr, gi = powers(log_dA, T * torch.arange(nc - 1, device=ar.device, dtype=ar.dtype))  # (H, n, nc - 1)
    scan = torch.cat([_toeplitz(gr, 1), _toeplitz(gi, 1)], dim=-1)  # (H, n, nc, 2 nc)
    return toeplitz, to_state, scan, from_state


def _toeplitz(taps: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """`(..., m)` taps -> `(..., T, T)` with `[j, i] = taps[i - j - shift]` where `0 <= i - j - shift < m`, else 0
    (`T = m + shift`; shift 0 or 1): the windows of the taps behind T zeros, last window first."""
    T = taps.shape[-1] + shift
    padded = torch.cat([taps.new_zeros(*taps.shape[:-1], T), taps], dim=-1)  # [p] = taps[p - T]
    windows = padded.unfold(-1, T, 1)  # (..., m + 1, T): window k holds [i] = taps[k + i - T]
    return windows[..., 1 - shift: T + 1 - shift, :].flip(-2)  # row j: window T - shift - j


def chunked_conv(u: torch.Tensor, log_dA, C_tilde, D: torch.Tensor | None, T: int, dtype: torch.dtype,
                 shift: int = 0) -> torch.Tensor:
    """`y = K * u (+ D u)` for `u (B, L, H)` -> `y (B, L, H)` in `dtype`, by chunks of `T` steps (see the module
    docs; `shift` as in `chunk_matrices`). The products read and write `dtype`; the matrices are made in the
    parameters' dtype, and the scan across chunks runs in float32 (or float64) whatever `dtype` is."""
    B, L, H = u.shape
    nc = -(-L // T)
    wide = log_dA[0].dtype  # float32, or float64 for reference checks
    toeplitz, to_state, scan, from_state = chunk_matrices(log_dA, C_tilde, D, T, nc, shift)
    # (B, L, H) -> (H, B, nc T) in dtype, zero-padded at the end (a causal convolution's outputs before the padding
    # do not read it): one copy, the channels' batched products read rows of T contiguous steps
    if nc * T == L:
        x = u.permute(2, 0, 1).to(dtype, memory_format=torch.contiguous_format)
    else:
        x = u.new_zeros(H, B, nc * T, dtype=dtype)
        x[..., :L] = u.permute(2, 0, 1)
    x = x.view(H, B * nc, T)  # (H, M, T), M = B nc chunks
    y = torch.bmm(x, toeplitz.to(dtype))  # within each chunk: (H, M, T)
    if nc > 1:
        n = log_dA[0].shape[1]
        S = torch.bmm(to_state.to(dtype), x.transpose(1, 2))  # (H, N, M): each chunk's own end state
        S = S.to(wide).view(H * n, 2 * B, nc)  # per (channel, mode): rows [Re S over b; Im S over b], chunks
        Z = torch.bmm(S, scan.reshape(H * n, nc, 2 * nc))  # (H n, 2B, 2nc): [[Re S Re G, Re S Im G], [Im S ...]]
        X = torch.stack([Z[:, :B, :nc] - Z[:, B:, nc:], Z[:, :B, nc:] + Z[:, B:, :nc]], dim=1)  # entering states
        X = X.to(dtype).view(H, 2 * n, B * nc)  # (H, N, M), rows as to_state's
        y = torch.baddbmm(y, X.transpose(1, 2), from_state.to(dtype))  # what they add: (H, M, T)
    y = y.view(H, B, nc * T)[..., :L]
    return y.permute(1, 2, 0).contiguous()  # (B, L, H)
