"""The fused S4D convolution for batches with fewer rows than a kernel program takes: the sequence cut into segments
that the kernels read as rows, and the state each segment starts from added afterwards.

A program of the fused kernels (`s4d_fused.py`) owns one channel and `LAUNCH` rows (16: the smallest tile of a
tensor-core product), walking the chunks in order. A step holds a fixed number of tokens, so long sequences come in
small batches: at 32K tokens a step and L 16,384 a batch has two rows, and 14 of every 16 rows a program computes
are padding. Here `x (H, B, L)` is read as `(H, B S, L / S)`, S segments per row, each convolved from a zero state
by the kernels; what the steps before a segment add to it is exact and cheap to add after (for S4D, whose state is
diagonal):

    E_s  = sum_c (dA^T)^(m - 1 - c) Z_(s,c),   Z_(s,c) = x_(s,c) to_state^T   the segment's end state from zero
    X_s  = sum_(r < s) (dA^(L/S))^(s - 1 - r) E_r                             the state it starts from
    y_(s,c) += ((dA^T)^c X_s) from_state                                      what that state adds to chunk c

with m chunks of T steps a segment and the kernels' own matrices (`chunk_matrices`). The products are batched
matmuls in float32, the powers `powers` (one exponential each); autograd gives the backward. The reference: the
kernels on the whole rows (`fused_conv_channels_first`), which tests compare this with, values and gradients.

Only where asked for: `S` given, or `UNDER_COMPILE` set and the step under `torch.compile`, where inductor fuses
these few dozen small operations into a few kernels. In eager mode they are about 185 more operations a layer,
forward and backward (`python bench/launches.py`: `layer/fused_segments` against `layer/fused`), each a launch the
host pays for (tens of microseconds on a GPU). Compiled, they still cost more than the programs' empty rows: see
`UNDER_COMPILE`.

Copied into Hub repositories with `modeling_s4.py`: it imports only torch and its siblings.
"""

import torch

from .s4d_chunked import _mul, powers
from .s4d_fused import LAUNCH, fused_conv_channels_first, fused_matrices


# Whether compiled steps cut short batches into segments: no. On an H200 the compiled ~100M S4D language model at 32K
# tokens a step (bench/results/2026-11-28-gpu-speed-NVIDIA-H200.md) took 75.6, 76.6 and 81.4 ms a step at L 4,096,
# 8,192 and 16,384 with segments (e1664d1), against 59.5, 61.0 and 63.0 ms reading the rows whole at f939b4e, before
# segments existed (at L 1,024 and 2,048, whose batches fill the programs, the two runs agree within 2.2%).
# `python bench/gpu_speed.py --sections segments` times them beside the default.
UNDER_COMPILE = False


def segments(B: int, nc: int | None = None, rows: int | None = None) -> int:
    """How many segments each of B rows of nc chunks is cut into: the smallest power of two that fills a program's
    `rows` (default: the kernels' `LAUNCH`), at most nc's largest power of two (None: rows of any length); 1: the
    rows as they are."""
    rows = rows or min(LAUNCH["forward"][0], LAUNCH["backward"][0])
    S = 1
    while B * S < rows and (nc is None or 2 * S <= nc):
        S *= 2
    return S


def fused_conv(x: torch.Tensor, log_dA, C_tilde, D, T: int, shift: int = 0, S: int | None = None,
               gelu: int = 0) -> torch.Tensor:
    """The fused convolution of `x (H, B, nc T)` (channels first, zeros past the sequence) with the kernel of
    `log_dA`, `C_tilde` (`(H, n)` pairs) and skip D, chunks of T steps: `(H, B, nc T)` in x's dtype (`gelu` 1 or 2:
    its GELU, in the kernels as `s4d_fused.GELU_MODES` says). Rows are cut into `S` segments where a batch would
    leave the kernels' programs part empty (default: `segments(B, nc)` under `torch.compile` where `UNDER_COMPILE`
    says so, else 1; see the module's docs)."""
    taps, to_state, from_state, step = fused_matrices(log_dA, C_tilde, D, T, shift)
    H, B, Lp = x.shape
    nc = Lp // T
    if S is None:
        S = segments(B, nc) if UNDER_COMPILE and torch.compiler.is_compiling() else 1
    if S == 1:
        return fused_conv_channels_first(x, taps, to_state, from_state, step, shift, gelu)
    m = -(-nc // S)  # chunks a segment
    if m * S != nc:  # zeros at the end change no earlier output
        x = torch.nn.functional.pad(x, (0, (m * S - nc) * T))
    Ls = m * T
    y = fused_conv_channels_first(x.reshape(H, B * S, Ls), taps, to_state, from_state, step, shift, segments=1)
    y = y.view(H, B, S, m, T).float() + _from_earlier_segments(x, log_dA, to_state, from_state, T, S, m)
    y = y.to(x.dtype).view(H, B, S * Ls)[..., :Lp]
    return torch.nn.functional.gelu(y) if gelu else y  # (each segment's output is complete only here)


def _from_earlier_segments(x, log_dA, to_state, from_state, T: int, S: int, m: int) -> torch.Tensor:
    """What the segments before each one add to its outputs: `(H, B, S, m, T)` float32."""
    H, B, _ = x.shape
    n = log_dA[0].shape[1]
    # Z: each chunk's contribution to the state, from zero: (H, B, S, m, n) pairs
    Z = torch.bmm(x.float().view(H, B * S * m, T), to_state.transpose(1, 2)).view(H, B, S, m, n, 2)
    Z = Z[..., 0], Z[..., 1]
    k = torch.arange(m, device=x.device, dtype=log_dA[0].dtype)
    # E: the end state of each segment from zero, (H, B, S, n)
    Pr, Pi = (p.permute(0, 2, 1)[:, None, None] for p in powers(log_dA, T * (m - 1 - k)))  # (H, 1, 1, m, n)
    Er, Ei = (e.sum(3) for e in _mul((Pr, Pi), Z))
    # X: the state each segment starts from, sum over r < s of dA^(Ls (s - 1 - r)) E_r
    s = torch.arange(S, device=x.device)
    lag = s[:, None] - 1 - s[None, :]  # (S, S): [s, r] = s - 1 - r
    Wr, Wi = powers(log_dA, (T * m * lag.clamp(min=0)).flatten().to(k.dtype))  # (H, n, S S)
    before = (lag >= 0).flatten().to(Wr.dtype)
    Wr, Wi = (w.mul(before).view(H, n, S, S) for w in (Wr, Wi))
    Xr = torch.einsum("hnsr,hbrn->hbsn", Wr, Er) - torch.einsum("hnsr,hbrn->hbsn", Wi, Ei)
    Xi = torch.einsum("hnsr,hbrn->hbsn", Wr, Ei) + torch.einsum("hnsr,hbrn->hbsn", Wi, Er)
    # V: the state entering chunk c of segment s from X_s alone, (dA^T)^c X_s; its outputs through from_state
    Qr, Qi = (q.permute(0, 2, 1)[:, None, None] for q in powers(log_dA, T * k))  # (H, 1, 1, m, n)
    Vr, Vi = _mul((Qr, Qi), (Xr[:, :, :, None], Xi[:, :, :, None]))  # (H, B, S, m, n)
    V = torch.stack([Vr, Vi], dim=-1).view(H, B * S * m, 2 * n)
    return torch.bmm(V, from_state).view(H, B, S, m, T)
