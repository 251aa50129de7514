"""S4 models in PyTorch, as `transformers` models: a causal language model and a sequence classifier.

Notation follows the S4/S4D papers: `H` channels (`d_model`), each an independent single-input single-output SSM
with state size `N` (`d_state`), stored as `N/2` complex modes whose conjugates are implied. Per channel:

    x'(t) = A x(t) + B u(t),   y(t) = C x(t) + D u(t)

Discretised with step `dt = exp(log_dt)` to `x_k = dA x_{k-1} + dB u_k`, `y_k = C x_k + D u_k`, which is a causal
convolution of `u` with the kernel `K[l] = C dA^l dB`. Two kernels:

- `S4DKernel` (`kernel="s4d"`): `A` diagonal. ZOH (`dA = exp(dt A)`, `dB = (dA - 1)/A`) or bilinear
  (`dA = (1 + dt A/2)/(1 - dt A/2)`, `dB = dt/(1 - dt A/2)`). `K[l] = 2 Re(sum_n C_n dB_n dA_n^l)`, a Vandermonde
  product. `B` is folded into `C` (both are per mode, so the family of kernels is the same).
- `S4Kernel` (`kernel="s4"`): `A = Lambda - P P^*`, normal plus low rank, initialised from HiPPO-LegS. Bilinear.
  The kernel's generating function at the roots of unity is a sum of Cauchy terms with a Woodbury correction for
  `P P^*`; an inverse FFT gives `K`. Its `C` is the reference's `C~ = C (I - dA^l_max)` (see `S4Config.l_max`).

Each kernel also has a recurrent form (`step`), the state a convolution leaves (`forward_state`) and the output an
initial state produces (`state_output`), so generation decodes one token in O(1) and long streams can be trained
chunk by chunk with carried state. `recurrence` runs the SSM step by step: the slow, obviously correct reference
every fast path is tested against.

With `ffn="mlp"` or `"moe"` each block adds a feed-forward sub-block after the S4 layer: a SwiGLU MLP or a mixture
of SwiGLU experts (`moe.py`), whose router losses join the output's `loss` and `aux_loss`.

This file is copied into Hub repositories for `trust_remote_code` loading: it imports only torch, transformers and
its siblings, which `save_pretrained` folds into it there (`code_bundle.py`).
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation import GenerationMode
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import ModelOutput, SequenceClassifierOutput
from transformers.utils import can_return_tuple

from .cache_names import cache_field, one_cache
from .code_bundle import SavesFoldedCode
from .configuration_s4 import S4Config
from .context_parallel import ChunkRows, ContextParallel
from .documents import Documents
from .moe import MOE_OUTPUTS, MoELayer, SwiGLUMLP, init_moe_weights, moe_losses
from .s4d_chunked import (chunk_matrices, conv_channels_first, discretize_pairs, fp32_or_wider, from_channels_first,
                          glu_kernels_run, parameter_pairs, project_channels_first, project_glu_channels_first,
                          to_channels_first)
from .s4d_fused import fused_discretize, gelu_in_kernels, ieee_products, why_not_fused
from .s4d_segments import fused_conv

# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _complex(t: torch.Tensor) -> torch.Tensor:
    """A parameter stored as (..., 2) real pairs (safetensors holds no complex dtype) as a complex tensor."""
    return torch.view_as_complex(fp32_or_wider(t).contiguous())


def _with_conjugates(t: torch.Tensor) -> torch.Tensor:
    """(..., N/2) modes -> (..., N): each mode followed, after all of them, by its complex conjugate."""
    return torch.cat([t, t.conj()], dim=-1)


class ConvPlan(NamedTuple):
    """How an S4 layer computes its convolution: `path` "fft", "chunked" (batched matmuls) or "fused" (the chunked
    form in one Triton kernel each way), the chunked form's steps per chunk and the dtype of its products' operands
    (`dtype` is float32 or float64 on the FFT path)."""

    path: str
    chunk: int
    dtype: torch.dtype

    def describe(self) -> str:
        if self.path == "fft":
            return "FFT (float32, length 2L)" if self.dtype != torch.float64 else "FFT (float64, length 2L)"
        how = "matmuls" if self.path == "chunked" else "products in one Triton kernel"
        return f"{self.path} ({str(self.dtype).removeprefix('torch.')} {how}, chunks of {self.chunk} steps)"


HALF = (torch.bfloat16, torch.float16)


def conv_plan(config: S4Config, device_type: str, input_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
              L: int | None = None) -> ConvPlan:
    """The convolution an S4 layer of `config` runs for inputs of `input_dtype` on `device_type` under autocast to
    `autocast_dtype` (None: no autocast). Chosen here alone (the layer and the line a run prints both ask).

    `conv_path="auto"`: the chunked form on CUDA for the diagonal kernel (its products run on tensor cores, FFTs do
    not), in the fused Triton kernel where it can run (`FUSED_BY_DEFAULT`), FFT elsewhere (on CPUs the FFT path is
    the faster). The chunked path's operands are bfloat16 under half
    precision (bfloat16 also under float16 autocast: a state sums up to ~1/(1 - |dA|) inputs, thousands, past
    float16's range), float32 or float64 otherwise, float32 on a GPU without bfloat16 matmuls."""
    path = config.conv_path
    if path == "auto":
        path = "chunked" if config.kernel == "s4d" and device_type == "cuda" else "fft"
    wide = torch.float64 if input_dtype == torch.float64 else torch.float32
    if path == "fft":
        return ConvPlan("fft", 0, wide)
    half = input_dtype in HALF or autocast_dtype in HALF
    if half and device_type == "cuda" and not _bf16_matmuls():
        half = False
    dtype = torch.bfloat16 if half else wide
    fused = config.conv_path == "fused" or (config.conv_path == "auto" and FUSED_BY_DEFAULT)
    if fused and _fused_runs(config, device_type, dtype):
        chunk = config.conv_chunk or fused_chunk(dtype)
        return ConvPlan("fused", chunk if L is None else min(chunk, _pow2_at_least(L)), dtype)
    chunk = config.conv_chunk or default_chunk(L)
    return ConvPlan("chunked", chunk if L is None else min(chunk, -(-L // 16) * 16), dtype)


# Whether `conv_path: auto` takes the fused kernels on CUDA, and their steps per chunk. Timed on an H200 against the
# chunked path (bench/results/2026-11-27-gpu-speed-NVIDIA-H200.md): faster at L 1K, 4K and 16K, eager and compiled.
# Chunks of 64: within 4% of the sweep's best at L 4K (128 steps, whose forward spills at 32 rows), and the longest
# float32 operands take.
FUSED_BY_DEFAULT = True
FUSED_CHUNK = 64
# Float32 products in IEEE precision (torch's default for float32 matmuls, unless `train.tf32`) hold more registers:
# compiled for sm_90 at their launch shapes, both kernels spill to local memory at chunks of 64 (the forward 3.2 KiB
# a thread, the backward 0.6 KiB) and neither does at 32 (tests/models/test_s4d_fused.py checks it). TF32 products
# fit at 64.
FUSED_CHUNK_IEEE = 32


def fused_chunk(dtype: torch.dtype) -> int:
    """The fused kernels' steps per chunk for operands of `dtype` when `conv_chunk` is None."""
    return FUSED_CHUNK_IEEE if ieee_products(dtype) else FUSED_CHUNK


def _pow2_at_least(L: int) -> int:
    return max(16, 1 << (L - 1).bit_length())


def _fused_runs(config: S4Config, device_type: str, dtype: torch.dtype) -> bool:
    """Whether the fused kernel computes this layer here; `conv_path="fused"` that cannot is refused (one line)."""
    why = why_not_fused(device_type, dtype, config.conv_chunk or fused_chunk(dtype), config.d_state,
                        zoh=config.disc == "zoh")
    if why and config.conv_path == "fused":
        raise ValueError(f"conv_path='fused' cannot run here: {why}; 'chunked' computes the same with batched matmuls")
    return why is None


def default_chunk(L: int | None) -> int:
    """Steps per chunk when `conv_chunk` is None: the Toeplitz products cost `2 T` per element and the scan across
    chunks `~4 N L / T^2`, so the best T grows about as the cube root of L (measured on an H200, bf16: 128 at L 1K,
    256 at 4K, 512 at 16K, each within a few percent of the next size)."""
    if L is None or L <= 2048:
        return 128
    return 256 if L <= 8192 else 512


@torch.compiler.assume_constant_result
def _bf16_matmuls() -> bool:
    """Whether this CUDA device multiplies bfloat16 natively: a constant to `torch.compile` (a bool from a torch
    function is otherwise a graph break in every layer)."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _FFTConv(torch.autograd.Function):
    """`irfft(rfft(u, n) rfft(k, n), n)[..., :L]` for u (B, H, L) and k (H, m), m <= n, with its backward written out:
    the adjoint of a convolution is a correlation, two real FFTs of (B, H, n) with the spectra kept from the forward.
    (Autograd's own backward of `rfft` is a complex FFT of length n plus padding, about twice a real one.)"""

    @staticmethod
    def forward(ctx, u, k, n):
        U, Kf = torch.fft.rfft(u, n=n), torch.fft.rfft(k, n=n)
        ctx.save_for_backward(U, Kf)
        ctx.sizes = (u.shape[-1], k.shape[-1], n)
        return torch.fft.irfft(U * Kf, n=n)[..., : u.shape[-1]]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        U, Kf = ctx.saved_tensors
        L, m, n = ctx.sizes
        G = torch.fft.rfft(grad, n=n)
        grad_u = torch.fft.irfft(G * Kf.conj(), n=n)[..., :L] if ctx.needs_input_grad[0] else None
        grad_k = torch.fft.irfft((G * U.conj()).sum(0), n=n)[..., :m] if ctx.needs_input_grad[1] else None
        return grad_u, grad_k, None


def fft_conv(u: torch.Tensor, K: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Convolution of `u (B, H, L)` with kernels `K (c, H, L)`; c = 1 causal, c = 2 bidirectional -> (B, H, L).

    Causal: `y[t] = sum_{s<=t} K[0, t-s] u[s]`. Bidirectional adds the anti-causal `sum_{s>t} K[1, s-t-1] u[s]`.
    Both are zero-padded to length 2L so the FFT product is a linear, not circular, convolution. `D (H,)`, if given,
    adds the skip term `D u` as the causal kernel's tap at lag 0 (no separate (B, H, L) product and sum).
    """
    L = u.shape[-1]
    k = K[0]  # taps 0..L-1 act on the past and present
    if D is not None:
        k = torch.cat([k[:, :1] + D[:, None], k[:, 1:]], dim=-1)
    if K.shape[0] == 2:  # taps L+1..2L-1 wrap around to act on the future, nearest last
        k = nn.functional.pad(k, (0, L)) + nn.functional.pad(K[1].flip(-1), (L, 0))
    return _FFTConv.apply(u, k, 2 * L)


def vandermonde_tables(log_dA: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Powers `dA^l`, l < L, factored as `dA^(I j) dA^i` (l = I j + i, I = 2^ceil(log2(L)/2) >= sqrt(L), j < J):
    `lo = dA^i (H, I, n)` and `hi = dA^(I j) (H, J, n)` from `log_dA (H, n)`. A sum over l against them is two small
    matmuls: O(n sqrt L) exponentials per channel, and nothing of size (n, L) is built, forward or backward. Each
    power is one exp of an exact multiple of log dA, so rounding is as for `exp(l log dA)`. `lo` is (I, n) per
    channel so that its real view is a (I, 2n) matrix too (`_DiagonalBlock.end_state`)."""
    I = 1
    while I * I < L:  # I = 2^ceil(log2(L)/2) in integers: under torch.compile with a dynamic L, a guard per power of 4
        I *= 2
    J = -(-L // I)
    l = torch.arange(max(I, J), device=log_dA.device, dtype=log_dA.real.dtype)
    return _cexp(log_dA[..., None, :] * l[:I, None]), _cexp(log_dA[..., None, :] * (I * l[:J, None]))


def _cexp(z: torch.Tensor) -> torch.Tensor:
    """`exp(z)` of a complex tensor as `polar(exp(Re z), Im z)`: torch's complex exp on CPU is not vectorised (about
    5x slower for the Vandermonde tables, measured on 2 cores); the same values to rounding."""
    return torch.polar(torch.exp(z.real), z.imag)


def vandermonde_product(v: torch.Tensor, log_dA: torch.Tensor, L: int,
                        tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`2 Re(sum_n v_n dA_n^l)` for l = 0..L-1: v (..., H, n), log_dA (H, n) complex -> (..., H, L) real. `tables`:
    `vandermonde_tables(log_dA, L)` when the caller has them already."""
    lo, hi = tables or vandermonde_tables(log_dA, L)
    K = (v[..., None, :] * hi) @ lo.transpose(-1, -2)  # (..., H, J, I): sum_n v_n dA_n^(I j + i)
    return 2 * K.real.flatten(-2)[..., :L]


def krylov(M: torch.Tensor, v: torch.Tensor, L: int) -> torch.Tensor:
    """`[v, M v, M^2 v, ..., M^(L-1) v]` by doubling: M (H, N, N), v (H, N) -> (H, N, L). O(log L) matmuls."""
    out, power = v[..., None], M
    while out.shape[-1] < L:
        out = torch.cat([out, power @ out], dim=-1)
        power = power @ power
    return out[..., :L]


def hippo_legs_nplr(N: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HiPPO-LegS in normal-plus-low-rank form, diagonalised, in float64 / complex128.

    LegS: `A_nk = -sqrt(2n+1) sqrt(2k+1)` (n > k), `-(n+1)` (n = k), 0 (n < k); `B_n = sqrt(2n+1)`. With
    `P_n = sqrt(n + 1/2)`, `S = A + P P^T = -I/2 + (skew-symmetric)` is normal: `S = V Lambda V^*`. Returns the
    `N/2` eigenvalues `Lambda` with positive imaginary part (the others are their conjugates), and `P~ = V^* P`,
    `B~ = V^* B` for those modes, so that in the eigenbasis `A = Lambda - P~ P~^*`.
    """
    n = torch.arange(N, dtype=torch.float64)
    q = torch.sqrt(2 * n + 1)
    A = -torch.tril(q[:, None] * q[None, :], diagonal=-1) - torch.diag(n + 1)
    P = torch.sqrt(n + 0.5)
    S = A + P[:, None] * P[None, :]
    skew = (S - S.T) / 2  # S = -I/2 + skew exactly
    w, V = torch.linalg.eigh(-1j * skew.to(torch.complex128))  # -i skew is Hermitian: skew = V diag(i w) V^*
    keep = w > 0  # one of each conjugate pair, in increasing frequency
    V = V[:, keep]
    Lambda = torch.complex(torch.full_like(w[keep], -0.5), w[keep])
    return Lambda, V.conj().T @ P.to(V.dtype), V.conj().T @ q.to(V.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Kernels


class _SSMKernel(nn.Module):
    """Shared by both kernels: `log_dt` per channel, `A` per SSM copy (`n_ssm` of them, each shared by
    `H / n_ssm` channels), `C` per channel and direction.

    Parameters (the optimizer gives `log_dt`, `log_A_real`, `A_imag`, `P` and `B` their own learning rate and no
    weight decay, by name):
        log_dt     (H,)             log step size
        log_A_real (S, N/2)         Re A = -exp(log_A_real) < 0 keeps every mode stable
        A_imag     (S, N/2)         Im A
        C          (c, H, N/2, 2)   complex C as (real, imag) pairs; c = 2 with a second, anti-causal kernel

    They stay float32 when the rest of the model is half precision (`_keep_in_fp32_modules_strict`): Im A reaches
    ~100, where bfloat16 steps by 0.5.
    """

    fsdp_forward_methods = ("state_output", "forward_state", "step_params", "block")
    """Methods besides `forward` that read the parameters: where this module is an FSDP unit of its own (the float32
    unit of mixed precision), each must gather them as `forward` does."""

    def __init__(self, config: S4Config):
        super().__init__()
        self.config = config
        # Every parameter is made float32 here, whatever the default dtype: transformers (5.24 and newer) builds a
        # model under the dtype it is loaded in and keeps `_keep_in_fp32_modules_strict` float32 only where
        # `__init__` made it so.
        H, N2 = config.d_model, config.d_state // 2
        S = config.n_ssm or H
        self.copies = H // S  # channels per SSM copy
        self.log_dt = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.log_A_real = nn.Parameter(torch.empty(S, N2, dtype=torch.float32))
        self.A_imag = nn.Parameter(torch.empty(S, N2, dtype=torch.float32))
        self.C = nn.Parameter(torch.empty(2 if config.bidirectional else 1, H, N2, 2, dtype=torch.float32))

    def _per_channel(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.copies, dim=0) if self.copies > 1 else t  # (S, ...) -> (H, ...)

    def _A(self) -> torch.Tensor:
        """A (H, N/2) complex64 (complex128 for fp64 parameters)."""
        A = torch.complex(-torch.exp(fp32_or_wider(self.log_A_real)), fp32_or_wider(self.A_imag))
        return self._per_channel(A)

    @torch.no_grad()
    def _init_common(self, A: torch.Tensor, C_scale: torch.Tensor | float = 1.0):
        """dt log-uniform in [dt_min, dt_max] per channel; `A (S, N/2)`; C ~ complex normal (unit variance) times
        `C_scale`."""
        cfg = self.config
        H = self.log_dt.shape[0]
        device = self.log_dt.device
        log_dt = torch.rand(H, device=device) * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min)
        init.copy_(self.log_dt, log_dt)
        init.copy_(self.log_A_real, torch.log(-A.real).to(device).float())
        init.copy_(self.A_imag, A.imag.to(device).float())
        C = torch.randn(*self.C.shape[:-1], dtype=torch.complex64, device=device)  # E|C|^2 = 1
        init.copy_(self.C, torch.view_as_real(C * torch.as_tensor(C_scale, device=device).to(C.dtype)))

    def recurrence(self, u: torch.Tensor, state: torch.Tensor | None = None,
                   starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Slow, obviously correct reference: the discrete SSM one step at a time. u: (B, H, L) -> y (B, H, L) and the
        final state. Equal to the convolution (plus `state_output` of `state`) up to rounding (see tests).
        `starts (B, L)` bool: a document starts there, its state from zero."""
        params = self.step_params()
        x = self.zero_state(u.shape[0], u) if state is None else state
        ys = []
        for k in range(u.shape[-1]):
            if starts is not None:
                x = x * ~starts[:, k, None, None]
            y, x = self.step(u[..., k], x, params)
            ys.append(y)
        return torch.stack(ys, dim=-1), x


class S4DKernel(_SSMKernel):
    """Diagonal state matrix (`kernel="s4d"`). The recurrent state is `(B, H, N/2)` complex; `y = 2 Re(C~ . x)`."""

    @torch.no_grad()
    def reset_parameters(self):
        """Structured S4D init; called from `S4PreTrainedModel._init_weights` (never N(0, std) like a Linear)."""
        S, N2 = self.A_imag.shape
        N = 2 * N2
        n = torch.arange(N2, dtype=torch.float64)
        C_scale = 1.0
        kind = self.config.ssm_init
        if kind == "diag-lin":  # S4D-Lin: A_n = -1/2 + i pi n
            A = torch.complex(torch.full_like(n, -0.5), math.pi * n)
        elif kind == "diag-inv":  # S4D-Inv: A_n = -1/2 + i (N/pi)(N/(2n+1) - 1)
            A = torch.complex(torch.full_like(n, -0.5), (N / math.pi) * (N / (2 * n + 1) - 1))
        elif kind == "diag-real":  # S4D-Real: A_n = -(n+1)
            A = torch.complex(-(n + 1), torch.zeros_like(n))
        else:  # diag-legs: the diagonal part of HiPPO-LegS's NPLR form, with its B (folded into C)
            A, _, B = hippo_legs_nplr(N)
            C_scale = torch.complex(B.real, B.imag.clamp(-2.0, 2.0))  # the reference clips Im B to [-2, 2]
        self._init_common(A.expand(S, N2), C_scale)

    def discretize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`log dA (H, N/2)` and `C~ = C dB (c, H, N/2)`, complex64 (complex128 for fp64 parameters)."""
        dt = torch.exp(fp32_or_wider(self.log_dt))[:, None]  # (H, 1)
        A = self._A()  # (H, N/2)
        dtA = A * dt
        if self.config.disc == "zoh":
            log_dA, dB = dtA, (torch.exp(dtA) - 1.0) / A
        else:  # bilinear
            log_dA, dB = torch.log((1.0 + dtA / 2) / (1.0 - dtA / 2)), dt / (1.0 - dtA / 2)
        return log_dA, _complex(self.C) * dB

    def discretize_pairs(self, fused: bool = False) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                             tuple[torch.Tensor, torch.Tensor]]:
        """`discretize()` in real arithmetic: `log dA` as (real, imaginary) `(H, N/2)` each, `C~` as (real,
        imaginary) `(c, H, N/2)` each, float32 (float64 for fp64 parameters). The chunked convolution reads these:
        inductor generates no code for complex tensors, so the path `torch.compile` runs has none. `fused`: by the
        fused path's Triton kernels where they run (`s4d_fused.fused_discretize`, which also reads the parameters
        as stored, their exponentials included; the same to rounding)."""
        params, zoh = (self.log_dt, self.log_A_real, self.A_imag, self.C), self.config.disc == "zoh"
        if fused:
            return fused_discretize(*params, zoh, self.copies)
        return discretize_pairs(*parameter_pairs(*params, self.copies), zoh)  # dt (H, 1), A and C as pairs

    def forward(self, L: int) -> torch.Tensor:
        """Kernels `K (c, H, L)` in float32 (or float64): `K[l] = 2 Re(sum_n C~_n dA_n^l)`."""
        return self.block(L).taps()

    # Recurrent form
    def zero_state(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        dtype = torch.complex128 if like.dtype == torch.float64 else torch.complex64
        H, N2 = self.log_dt.shape[0], self.A_imag.shape[1]
        return torch.zeros(batch, H, N2, dtype=dtype, device=like.device)  # (B, H, N/2)

    def step_params(self) -> dict:
        log_dA, C_tilde = self.discretize()
        return {"dA": torch.exp(log_dA), "C": C_tilde[0]}

    def step(self, u: torch.Tensor, x: torch.Tensor, p: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """u (B, H), x (B, H, N/2) -> y (B, H), next x. `x_k = dA x_{k-1} + u_k` (B folded into C~)."""
        x = p["dA"] * x + u[..., None]
        return 2 * (p["C"] * x).sum(-1).real, x

    def forward_state(self, u: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """The state after reading `u (B, H, L)` from `state` (zero if None):
        `x_L = dA^L x_0 + sum_k dA^(L-1-k) u_k`."""
        block = self.block(u.shape[-1])
        x = block.end_state(u)
        return x if state is None else x + block.advance(state)

    def state_output(self, state: torch.Tensor, L: int, direction: int = 0) -> torch.Tensor:
        """What an initial state adds to the next L outputs: `y_k += 2 Re(C~ dA^(k+1) x_0)`.
        (B, H, N/2) -> (B, H, L). `direction=1`: what the state of reading the steps after a block backwards adds to
        the block through the anti-causal kernel, `y_(L-1-r) += 2 Re(C~_1 dA^r x_0)`."""
        return self.block(L).reach(state, direction)

    def block(self, L: int) -> "_DiagonalBlock":
        """The state-passing pieces of a block of L steps, discretised once (`_DiagonalBlock`)."""
        return _DiagonalBlock(*self.discretize(), L)


class _DiagonalBlock:
    """S4D over a block of L steps, for passing states across blocks (carried state, context parallelism): the end
    state of reading a block, a state moved L steps on, what a state before the block adds to its outputs. The
    Vandermonde tables `dA^l` (`vandermonde_tables`) are made once for all three."""

    def __init__(self, log_dA: torch.Tensor, C_tilde: torch.Tensor, L: int):
        self.log_dA, self.C, self.L = log_dA, C_tilde, L
        self.lo, self.hi = vandermonde_tables(log_dA, L)  # (H, I, n), (H, J, n)

    def end_state(self, u: torch.Tensor) -> torch.Tensor:
        """`sum_k dA^(L-1-k) u_k` for u (B, H, L) real -> (B, H, n) complex. Real inputs times the tables' real and
        imaginary parts in one real matmul (a view of the table, no copy): the product keeps u and the table for its
        backward, not a complex copy of u."""
        L, (J, I) = self.L, (self.hi.shape[-2], self.lo.shape[-2])
        u_rev = nn.functional.pad(u.flip(-1), (0, I * J - L)).unflatten(-1, (J, I))  # u_(L-1-l), l = I j + i
        x = u_rev @ torch.view_as_real(self.lo).flatten(-2)  # (B, H, J, 2n): sum_i dA^i u_(L-1-l), as pairs
        return (torch.view_as_complex(x.unflatten(-1, (-1, 2))) * self.hi).sum(-2)  # sum_j dA^(I j) ...

    def advance(self, x: torch.Tensor) -> torch.Tensor:
        """The state L steps later without input: `dA^L x`."""
        return torch.exp(self.log_dA * self.L) * x

    def reach(self, x: torch.Tensor, direction: int = 0) -> torch.Tensor:
        """`2 Re(C~ dA^(k+1) x)` at k = 0..L-1; `direction=1`: `2 Re(C~_1 dA^r x)` at r = L-1-k. (B, H, L)."""
        v = x * self.C[1] if direction else x * self.C[0] * torch.exp(self.log_dA)
        y = vandermonde_product(v, self.log_dA, self.L, (self.lo, self.hi))
        return y.flip(-1) if direction else y

    def taps(self) -> torch.Tensor:
        """The convolution kernels `K (c, H, L)` from the same tables (`S4DKernel.forward`)."""
        return vandermonde_product(self.C, self.log_dA, self.L, (self.lo, self.hi))


class S4Kernel(_SSMKernel):
    """Normal plus low rank state matrix `A = Lambda - P P^*` (`kernel="s4"`), bilinear, from HiPPO-LegS.

    Extra parameters (per SSM copy, no weight decay): `P (S, N/2, 2)` and `B (S, N/2, 2)`, complex as pairs.

    Convolution: the kernel's generating function at the L-th roots of unity `z`,
    `K^(z) = C~ (I - z dA)^-1 dB = C~ M(z)^-1 B` with `M(z) = (1-z)/dt - (1+z)/2 A` (bilinear), is a sum of
    Cauchy terms `1/((1-z)/dt - (1+z)/2 lambda_n)` over all N modes (each `N/2` one plus its conjugate) with the
    Woodbury correction for the rank-1 term; `K = irfft(K^)`. Nothing of size (B, H, N, L) is built.

    Recurrent form: the full N-dimensional complex eigenbasis (modes and conjugates), dense `dA (H, N, N)`,
    `y = Re(C x)`, with the true `C = C~ (I - dA^l_max)^-1`.
    """

    def __init__(self, config: S4Config):
        super().__init__(config)
        S, N2 = self.A_imag.shape
        self.P = nn.Parameter(torch.empty(S, N2, 2, dtype=torch.float32))
        self.B = nn.Parameter(torch.empty(S, N2, 2, dtype=torch.float32))

    @torch.no_grad()
    def reset_parameters(self):
        S, N2 = self.A_imag.shape
        Lambda, P, B = hippo_legs_nplr(2 * N2)
        B = torch.complex(B.real, B.imag.clamp(-2.0, 2.0))  # as the reference: clip Im B to [-2, 2]
        self._init_common(Lambda.expand(S, N2))
        init.copy_(self.P, torch.view_as_real(P.to(torch.complex64)).expand(S, N2, 2))
        init.copy_(self.B, torch.view_as_real(B.to(torch.complex64)).expand(S, N2, 2))

    def _ssm(self):
        """dt (H,), Lambda, P, B (H, N/2) complex."""
        return (torch.exp(fp32_or_wider(self.log_dt)), self._A(), self._per_channel(_complex(self.P)),
                self._per_channel(_complex(self.B)))

    def _kernel_length(self, L: int) -> int:
        """l_max, doubled until it covers L."""
        n = self.config.l_max
        while n < L:
            n *= 2
        return n

    def forward(self, L: int) -> torch.Tensor:
        """Kernels `K (c, H, L)` in float32 (or float64)."""
        Lk = self._kernel_length(L)
        dt, Lambda, P, B = self._ssm()
        C_tilde = _complex(self.C) if Lk == self.config.l_max else self._c_tilde(Lk)  # (c, H, N/2)
        k = torch.arange(Lk // 2 + 1, device=dt.device, dtype=dt.dtype)
        z = torch.polar(torch.ones_like(k), -2 * math.pi * k / Lk)  # rfft frequencies, (Lk/2+1,)
        a = (1 - z)[None, :] / dt[:, None]  # (H, F)
        b = (1 + z) / 2  # (F,)

        def cauchy(v):  # sum over all N modes of v_n / (a - b lambda_n); the conjugate modes carry conj(v_n)
            r = torch.einsum("...hn,hnf->...hf", v, 1 / (a[:, None, :] - b * Lambda[..., None]))
            return r + torch.einsum("...hn,hnf->...hf", v.conj(), 1 / (a[:, None, :] - b * Lambda.conj()[..., None]))

        k00, k01 = cauchy(C_tilde * B), cauchy(C_tilde * P)  # (c, H, F)
        k10, k11 = cauchy(P.conj() * B), cauchy(P.conj() * P)  # (H, F)
        # Woodbury: (R^-1 + b P P^*)^-1 = R - b R P (1 + b P^* R P)^-1 P^* R
        K_hat = k00 - b * k01 * k10 / (1 + b * k11)
        return torch.fft.irfft(K_hat, n=Lk)[..., :L]

    # Dense form in the full eigenbasis (modes and conjugates): recurrence, state transfer, longer kernels
    def _dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Bilinear `dA (H, N, N)` and `dB (H, N)`:
        `dA = (I - dt/2 A)^-1 (I + dt/2 A)`, `dB = (I - dt/2 A)^-1 dt B`."""
        dt, Lambda, P, B = self._ssm()
        Pf, Bf = _with_conjugates(P), _with_conjugates(B)
        A = torch.diag_embed(_with_conjugates(Lambda)) - Pf[:, :, None] * Pf.conj()[:, None, :]
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        half = (dt / 2)[:, None, None] * A
        dA = torch.linalg.solve(eye - half, eye + half)
        dB = torch.linalg.solve(eye - half, (dt[:, None] * Bf)[..., None])[..., 0]
        return dA, dB

    def _c_true(self, dA: torch.Tensor) -> torch.Tensor:
        """The output matrix `C = C~ (I - dA^l_max)^-1`, (c, H, N), from the stored `C~`."""
        Cf = _with_conjugates(_complex(self.C))  # (c, H, N)
        eye = torch.eye(dA.shape[-1], dtype=dA.dtype, device=dA.device)
        M = eye - torch.linalg.matrix_power(dA, self.config.l_max)  # (H, N, N)
        return torch.linalg.solve(M.transpose(-1, -2), Cf[..., None])[..., 0]  # row vector: C M = C~

    def _c_tilde(self, L: int) -> torch.Tensor:
        """`C~` for a kernel of length L: `C (I - dA^L)`, first N/2 modes (the rest are their conjugates)."""
        dA, _ = self._dense()
        C = self._c_true(dA)
        C_L = C - torch.einsum("chn,hnm->chm", C, torch.linalg.matrix_power(dA, L))
        return C_L[..., : dA.shape[-1] // 2]

    def zero_state(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        dtype = torch.complex128 if like.dtype == torch.float64 else torch.complex64
        H, N = self.log_dt.shape[0], 2 * self.A_imag.shape[1]
        return torch.zeros(batch, H, N, dtype=dtype, device=like.device)  # (B, H, N)

    def step_params(self) -> dict:
        dA, dB = self._dense()
        return {"dA": dA, "dB": dB, "C": self._c_true(dA)[0]}

    def step(self, u: torch.Tensor, x: torch.Tensor, p: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """u (B, H), x (B, H, N) -> y (B, H), next x: `x_k = dA x_{k-1} + dB u_k`, `y_k = Re(C x_k)`."""
        x = torch.einsum("hnm,bhm->bhn", p["dA"], x) + p["dB"] * u[..., None]
        return (p["C"] * x).sum(-1).real, x

    def forward_state(self, u: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """`x_L = dA^L x_0 + sum_k dA^(L-1-k) dB u_k`, (B, H, L) -> (B, H, N)."""
        block = self.block(u.shape[-1])
        x = block.end_state(u)
        return x if state is None else x + block.advance(state)

    def state_output(self, state: torch.Tensor, L: int, direction: int = 0) -> torch.Tensor:
        """`y_k += Re(C dA^(k+1) x_0)`, (B, H, N) -> (B, H, L). `direction=1`: the anti-causal kernel's
        `y_(L-1-r) += Re(C_1 dA^r x_0)` (see `S4DKernel.state_output`)."""
        return self.block(L).reach(state, direction)

    def block(self, L: int) -> "_DenseBlock":
        """The state-passing pieces of a block of L steps (`_DenseBlock`), the dense form made once."""
        dA, dB = self._dense()
        return _DenseBlock(dA, dB, self._c_true(dA), L, lambda: self(L))


class _DenseBlock:
    """`_DiagonalBlock` for the dense (N, N) transition of the DPLR kernel, in its full complex eigenbasis. A long
    block is read in sub-blocks of `SUB` steps: Krylov tables (H, N, SUB) and one state per sub-block, handed from
    sub-block to sub-block by `dA^SUB` (a loop of L / SUB small products), rather than (H, N, L) tables (N times a
    block's inputs)."""

    SUB = 256

    def __init__(self, dA: torch.Tensor, dB: torch.Tensor, C: torch.Tensor, L: int, taps):
        self.dA, self.dB, self.C, self.L = dA, dB, C, L
        self.taps = taps  # the kernel's own convolution kernels (its Cauchy form, not these tables)
        self.T = min(L, self.SUB)
        self.nb = -(-L // self.T)  # sub-blocks; the last one padded

    def _step(self, x: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
        return torch.einsum("hnm,bhm->bhn", power, x)

    def end_state(self, u: torch.Tensor) -> torch.Tensor:
        """`sum_k dA^(L-1-k) dB u_k`: each sub-block's own end state, then folded first to last."""
        T, nb = self.T, self.nb
        u = nn.functional.pad(u, (nb * T - self.L, 0)).unflatten(-1, (nb, T))  # zeros first: they add nothing
        own = torch.einsum("bhjt,hnt->bhjn", u.flip(-1).to(self.dA.dtype), krylov(self.dA, self.dB, T))
        power, x = torch.linalg.matrix_power(self.dA, T), own[:, :, 0]
        for j in range(1, nb):
            x = self._step(x, power) + own[:, :, j]
        return x

    def advance(self, x: torch.Tensor) -> torch.Tensor:
        return self._step(x, torch.linalg.matrix_power(self.dA, self.L))

    def reach(self, x: torch.Tensor, direction: int = 0) -> torch.Tensor:
        """`Re(C dA^(k+1) x)` at k < L (`direction=1`: `Re(C_1 dA^r x)` at r = L-1-k): the state at each
        sub-block's start, then a Krylov table of T rows for all of them."""
        T, nb = self.T, self.nb
        power, starts = torch.linalg.matrix_power(self.dA, T), [x]
        for _ in range(1, nb):
            starts.append(self._step(starts[-1], power))
        dAt = self.dA.transpose(-1, -2)
        # (H, N, T): (C dA^(t+1))^T, or (C_1 dA^t)^T
        rows = krylov(dAt, self.C[1], T) if direction else krylov(dAt, self.C[0], T + 1)[..., 1:]
        y = torch.einsum("hnt,bhjn->bhjt", rows, torch.stack(starts, 2)).real.flatten(-2)[..., : self.L]
        return y.flip(-1) if direction else y


# ----------------------------------------------------------------------------------------------------------------
# Layers


class S4Layer(nn.Module):
    """One S4 layer: SSM convolution + D skip, GELU, dropout, then a GLU output projection. (B, L, H) -> (B, L, H)."""

    def __init__(self, config: S4Config):
        super().__init__()
        self.config = config
        H = config.d_model
        self.kernel = S4DKernel(config) if config.kernel == "s4d" else S4Kernel(config)
        self.D = nn.Parameter(torch.empty(H))  # (H,) skip connection, y += D u
        self.activation = nn.GELU()
        self.dropout = nn.Dropout(config.dropout)
        self.output_linear = nn.Linear(H, 2 * H)  # GLU halves it back to H
        self.glu = nn.GLU(dim=-1)

    def _mix(self, y: torch.Tensor, rows: ChunkRows | None = None) -> torch.Tensor:
        """Pointwise nonlinearity and mixing across channels: (..., H) -> (..., H)."""
        return self.glu(self.output_linear(_dropout(self.dropout, self.activation(y), rows)))

    def forward(self, u: torch.Tensor, state: torch.Tensor | None = None, return_state: bool = False,
                documents: Documents | None = None, rows: ChunkRows | None = None):
        """u (B, L, H) -> y (B, L, H) and, with `return_state`, the SSM state after the last step (else None).
        `state`: the SSM state before the first step (None: zeros). `documents`: each document of a packed row read
        on its own (the state reaches only the row's first one, when it continues; the state returned is the last
        one's). `rows`: u is one chunk of longer sequences split across a context-parallel group; the other
        chunks' contributions are exchanged (`_from_other_chunks`)."""
        L = u.shape[1]
        if rows is not None and (state is not None or return_state):
            raise ValueError("context parallelism splits whole sequences: it carries no state in or out")
        autocast = _autocast_dtype(u.device.type)
        plan = conv_plan(self.config, u.device.type, u.dtype, autocast, L)
        # The SSM in float32 whatever the autocast dtype: exp(dtA * l) over long l and the FFT lose everything in half
        # precision (log_dt going NaN under fp16 is a known report against the reference). The chunked path makes
        # its matrices in float32 and rounds only the operands of its products to plan.dtype.
        with torch.autocast(device_type=u.device.type, enabled=False):
            D = fp32_or_wider(self.D)
            reach = None  # what the steps before this block (a state, other chunks) add to its outputs: (B, H, L)
            if state is not None:
                reach = self.kernel.state_output(state, L)
                reach = reach if documents is None else reach * documents.first[:, None, :]
            block = None
            if rows is not None:  # discretised once for the convolution and the exchange
                block = self.kernel.block(L)
                reach = self._from_other_chunks(u, documents, rows, block)
            channels_first = plan.path != "fft" and documents is None and self._plain_projection()
            # GELU in the fused kernels as they write y, where `s4d_fused.GELU_IN_KERNELS` says so: a causal layer
            # (one kernel makes y) to whose y nothing is added after them
            gelu = gelu_in_kernels() if plan.path == "fused" else 0
            activated = (bool(gelu) and channels_first and reach is None and self.kernel.C.shape[0] == 1
                         and self._plain_activation())
            if channels_first:
                # channels first from the convolution through GELU and the projection: no transpose but the input's
                y = self._chunked_channels_first(u, plan.chunk, plan.dtype, D, fused=plan.path == "fused",
                                                 gelu=gelu if activated else 0)  # (H, B, L)
                if reach is not None:
                    y = y + reach.permute(1, 0, 2)
            else:
                conv = self._fft_conv(L, D, block) if plan.path == "fft" else self._chunked_conv(plan, D)
                y = conv(u) if documents is None else documents.apply(conv, u)  # (B, L, H), with the skip D u
                if reach is not None:
                    y = y + reach.transpose(1, 2)
            new_state = None
            if return_state:
                u32 = fp32_or_wider(u).transpose(1, 2)  # (B, H, L)
                if documents is None:
                    new_state = self.kernel.forward_state(u32, state)
                else:  # the row's last document, from zero unless it is the continued first one
                    carried = None if state is None else state * (documents.single & documents.continues)[:, None, None]
                    new_state = self.kernel.forward_state(u32 * documents.last[:, None, :], carried)
        if channels_first:
            return self._mix_channels_first(y.to(plan.dtype), autocast, rows, activated), new_state
        # GELU and the Linear on a contiguous (B, L, H) rather than the transposed view: ~10% of the layer
        return self._mix(y.contiguous().to(u.dtype if plan.path == "fft" else plan.dtype), rows), new_state

    def _from_other_chunks(self, u: torch.Tensor, documents: Documents | None, rows: ChunkRows,
                           block) -> torch.Tensor:
        """What the rest of the sequence adds to this chunk `u (B, L, H)` of it: (B, H, L), float32 (or float64).

        Every process reads its chunk from a zero state to the end state `s_q` (and, bidirectional, backwards to
        the state at its start); one gather hands all of them to every process. Chunk p starts from
        `x_p = a_(p-1) dA^L x_(p-1) + s_(p-1)` (`a_q` per row: the state passes through chunk q, no document starts
        in it), and the anti-causal kernel reads the later chunks' backward states the same way from the end."""
        parallel = rows.parallel
        u32 = fp32_or_wider(u).transpose(1, 2)  # (B, H, L)
        B = u32.shape[0]
        bidirectional = self.kernel.C.shape[0] == 2
        if bidirectional and (documents is not None or rows.fresh is not None):
            raise ValueError("context parallelism does not split the packed documents of a bidirectional model")
        if documents is None:  # one document per row, continued unless the chunk's first position starts one
            passes = torch.ones(B, dtype=torch.bool, device=u.device) if rows.fresh is None else ~rows.fresh
            reaches = None if rows.fresh is None else passes[:, None, None]
            own = block.end_state(u32)  # (B, H, n) complex
        else:
            passes = documents.single & documents.continues
            reaches = documents.first[:, None, :]
            own = block.end_state(u32 * documents.last[:, None, :])  # the chunk's last document's
        parts = [own] + ([block.end_state(u32.flip(-1))] if bidirectional else [])
        # as real pairs (gloo and NCCL have no complex dtype); `real`/`imag` rather than `view_as_real`, whose
        # backward needs its gradient at an even storage offset, which a slice of this row need not be
        sent = torch.cat([torch.stack([p.real, p.imag], -1).flatten(1) for p in parts]
                         + [passes[:, None].to(u32.dtype)], 1)
        got = parallel.gather(sent)  # (P, B, n): one collective, its size independent of L
        width = sent.shape[1] - 1
        states = [torch.complex(*t.reshape(parallel.size, *own.shape, 2).unbind(-1))
                  for t in got[..., :width].chunk(len(parts), dim=-1)]  # each (P, B, H, n)
        x = torch.zeros_like(own)
        for q in range(parallel.rank):  # the chunks before this one, first to last
            x = block.advance(x) * got[q, :, -1, None, None] + states[0][q]
        # `0 *` every gathered value: the gather is in the graph on every process, so every one joins its backward
        x = x + 0 * got.sum()
        reach = block.reach(x) if reaches is None else block.reach(x) * reaches
        if bidirectional:
            x = torch.zeros_like(own)
            for q in range(parallel.size - 1, parallel.rank, -1):  # the chunks after this one, last to first
                x = block.advance(x) + states[1][q]
            reach = reach + block.reach(x, direction=1)
        return reach

    def _plain_projection(self) -> bool:
        """The output projection is a plain Linear whose weight `forward` may read directly (not one wrapped by an
        adapter such as PEFT's LoRA, nor one whose parameters DeepSpeed ZeRO-3 gathers in the module's own hook)."""
        return type(self.output_linear) is nn.Linear and not hasattr(self.output_linear.weight, "ds_id")

    def _plain_activation(self) -> bool:
        """The activation is the exact GELU the fused kernels can apply themselves (not one a user swapped in)."""
        return type(self.activation) is nn.GELU and self.activation.approximate == "none"

    def _chunked_channels_first(self, u: torch.Tensor, T: int, dtype: torch.dtype, D: torch.Tensor,
                                pairs=None, fused: bool = False, gelu: int = 0) -> torch.Tensor:
        """u (B, L, H) -> the convolution with its D skip in chunks of T steps, channels first: (H, B, L) in dtype.
        `pairs`: the kernel's `discretize_pairs()`, when the caller has them already. `fused`: the Triton kernel
        (`s4d_fused`) rather than the batched matmuls (`s4d_chunked`); the same function to rounding. `gelu`
        (fused, causal: 1 or 2, `s4d_fused.GELU_MODES`' index): GELU of the result, in the kernels."""
        B, L, H = u.shape
        nc = -(-L // T)
        log_dA, (Cr, Ci) = pairs or self.kernel.discretize_pairs(fused)

        def conv(x, C, D, shift=0):  # (H, B, nc T) -> the same
            if fused:  # (short batches: their rows cut into segments, s4d_segments.py)
                return fused_conv(x, log_dA, C, D, T, shift, gelu=gelu)
            return conv_channels_first(x, *chunk_matrices(log_dA, C, D, T, nc, shift), nc=nc, shift=shift)

        # one kernel: squeeze, whose backward is a view, rather than a select's zeros and copy (eager launches)
        causal = (Cr[0], Ci[0]) if Cr.shape[0] == 2 else (Cr.squeeze(0), Ci.squeeze(0))
        y = conv(to_channels_first(u, dtype, nc * T), causal, D)  # zeros past L
        if Cr.shape[0] == 2:  # the anti-causal kernel: the reversed sequence, strictly after each step
            back = conv(to_channels_first(u.flip(1), dtype, nc * T), (Cr[1], Ci[1]), None, 1)
            y = y[..., :L] + back[..., :L].flip(-1)
        return y[..., :L] if y.shape[-1] != L else y

    def _mix_channels_first(self, y: torch.Tensor, autocast: torch.dtype | None,
                            rows: ChunkRows | None = None, activated: bool = False) -> torch.Tensor:
        """`_mix` of a channels-first `y (H, B, L)` -> (B, L, H): GELU (unless `activated`: y is GELU's output
        already) and dropout in that layout, the projection reading it as it lies (`project_channels_first`), the GLU
        on its (B, L, 2H) output (on CUDA, eager: in a Triton kernel each way, `project_glu_channels_first`)."""
        H, B, L = y.shape
        z = _dropout(self.dropout, y if activated else self.activation(y), rows, time_dim=2).reshape(H, B * L)
        linear = self.output_linear
        if glu_kernels_run(z):
            return project_glu_channels_first(z, linear.weight, linear.bias, autocast or z.dtype).view(B, L, H)
        z = project_channels_first(z, linear.weight, linear.bias, autocast or z.dtype)  # (B L, 2H)
        return self.glu(z.view(B, L, 2 * H))

    def _fft_conv(self, L: int, D: torch.Tensor, block=None):
        """(n, l, H) -> (n, l, H) float32 (a transposed view), l <= L: FFTs of the kernel's first l taps. `block`:
        the kernel's `block(L)`, when the caller has it (its taps come from the same tables)."""
        K = self.kernel(L) if block is None else block.taps()
        return lambda v: fft_conv(fp32_or_wider(v).transpose(1, 2), K[..., :v.shape[1]], D).transpose(1, 2)

    def _chunked_conv(self, plan: "ConvPlan", D: torch.Tensor):
        """(n, l, H) -> (n, l, H) in plan.dtype, l <= L: `_chunked_channels_first` and back (packed documents; an
        adapted projection)."""
        fused = plan.path == "fused"
        pairs = self.kernel.discretize_pairs(fused)

        def conv(v):  # a short document is one chunk
            steps = v.shape[1]
            T = min(plan.chunk, _pow2_at_least(steps) if fused else -(-steps // 16) * 16)
            return from_channels_first(self._chunked_channels_first(v, T, plan.dtype, D, pairs, fused), steps)
        return conv

    def step(self, u: torch.Tensor, state: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """One time step: u (B, H) -> y (B, H), next state. `params` from `self.kernel.step_params()`."""
        with torch.autocast(device_type=u.device.type, enabled=False):
            u32 = fp32_or_wider(u)
            y, state = self.kernel.step(u32, state, params)
            y = y + u32 * fp32_or_wider(self.D)
        return self._mix(y.to(u.dtype)), state


def _dropout(dropout: nn.Dropout, x: torch.Tensor, rows: ChunkRows | None, time_dim: int = 1) -> torch.Tensor:
    """`dropout(x)`, or under context parallelism masks that depend on each position's place in the whole sequence
    (the same whichever process holds it)."""
    if rows is None or not dropout.training:
        return dropout(x)
    return rows.parallel.dropout(x, dropout.p, time_dim)


def _norm(config: S4Config) -> nn.Module:
    if config.norm == "layer":
        return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
    return _BatchNormChannels(config.d_model, eps=config.layer_norm_eps)


class _BatchNormChannels(nn.BatchNorm1d):
    """BatchNorm over batch and time for (..., H) inputs, statistics per channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # (B, H): one time step
            return super().forward(x)
        return super().forward(x.transpose(1, 2)).transpose(1, 2)  # (B, L, H) -> (B, H, L) and back


class S4Block(GradientCheckpointingLayer):
    """Residual block. Pre-norm: `x + dropout(S4Layer(norm(x)))`; post-norm: `norm(x + dropout(S4Layer(x)))`. With
    `ffn` set, a second residual sub-block of the same form around a SwiGLU MLP or an `MoELayer` follows.
    forward/step return (x, SSM state, MoE aux dict or None)."""

    def __init__(self, config: S4Config):
        super().__init__()
        self.prenorm = config.prenorm
        self.norm = _norm(config)
        self.layer = S4Layer(config)
        self.dropout = nn.Dropout(config.dropout)
        self.is_moe = config.ffn == "moe"
        if config.ffn != "none":
            self.ffn_norm = _norm(config)
            self.ffn = MoELayer(config, config.d_model) if self.is_moe else SwiGLUMLP(config.d_model, config.d_ffn)
        else:
            self.ffn = None

    def _residual(self, x, f, norm, rows=None):
        z = norm(x) if self.prenorm else x
        y, extra = f(z)
        x = x + _dropout(self.dropout, y, rows)
        return (x if self.prenorm else norm(x)), extra

    def _feed_forward(self, x, mask=None, rows=None):
        if self.ffn is None:
            return x, None
        if self.is_moe:
            parallel = rows.parallel if rows is not None else None
            return self._residual(x, lambda z: self.ffn(z, mask, parallel), self.ffn_norm, rows)
        return self._residual(x, lambda z: (self.ffn(z), None), self.ffn_norm, rows)

    def forward(self, x, mask=None, state=None, return_state=False, documents=None, rows=None):
        def ssm(z):
            if mask is not None:
                # Padded positions feed zeros into the SSM, so a left-padded prompt leaves the same state as no
                # padding.
                z = z * mask[..., None].to(z.dtype)
            return self.layer(z, state, return_state, documents, rows)

        x, state = self._residual(x, ssm, self.norm, rows)
        x, aux = self._feed_forward(x, mask, rows)
        return x, state, aux

    def step(self, x, state, params, mask=None):
        """x (B, H) at one time step; `mask (B,)`, if given, reads 0 as padding, as `forward` does."""
        def ssm(z):
            if mask is not None:
                z = z * mask[:, None].to(z.dtype)
            return self.layer.step(z, state, params)

        x, state = self._residual(x, ssm, self.norm)
        x, aux = self._feed_forward(x, mask)
        return x, state, aux


# ----------------------------------------------------------------------------------------------------------------
# Recurrent state


class S4Cache:
    """The recurrent state of every layer, carried between `generate()` steps (as `cache`) or between the
    chunks of a long sequence (stateful training). `states[i]`: layer i's SSM state after the last position read;
    `seqlen_offset`: how many positions (padding included) the states have read, so that `generate()` continuing from
    this cache with the whole sequence feeds only the positions after them, and a forward given an `attention_mask`
    over the read and the new positions knows which columns are new."""

    is_compileable = False  # generate() asks before deciding to compile the forward
    is_croppable = False  # a recurrent state cannot be rolled back to an earlier position

    def __init__(self, states: list[torch.Tensor] | None = None, seqlen_offset: int = 0):
        self.states = states
        self.seqlen_offset = seqlen_offset
        self.step_params: list[dict] | None = None  # discrete (dA, dB, C) of each layer, computed once per decode

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: a recurrent state, not keys and values (all of them). `generate()` (transformers >= 5.24) asks
        before trimming the positions a cache has read from a continued prompt; `prepare_inputs_for_generation`
        trims them here."""
        return [True] * len(self.states or ())

    @property
    def has_previous_state(self) -> bool:
        return self.states is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions read so far (the name transformers' caches use)."""
        return self.seqlen_offset if self.states is not None else 0

    def detach(self) -> "S4Cache":
        """The same state without its autograd history (truncated backpropagation through time)."""
        return S4Cache([s.detach() for s in self.states] if self.states is not None else None, self.seqlen_offset)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.states is not None:
            self.states = [s.index_select(0, beam_idx.to(s.device)) for s in self.states]


@cache_field("cache_params")  # the field's name before transformers 5.24
@dataclass
class S4ModelOutput(ModelOutput):
    """With `ffn="moe"`: `aux_loss` (weighted router losses), `router_logits` per MoE layer, `expert_counts
    (n_layer, E)` and `dropped_counts (n_layer,)` (see `MoECausalLMOutput`)."""

    last_hidden_state: torch.FloatTensor | None = None
    cache: S4Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None
    balance_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_counts: torch.LongTensor | None = None
    dropped_counts: torch.LongTensor | None = None


@cache_field("cache_params")
@dataclass
class S4CausalLMOutput(ModelOutput):
    """`loss` includes `aux_loss` (the weighted router losses) when the model has MoE blocks."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: S4Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None
    balance_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_counts: torch.LongTensor | None = None
    dropped_counts: torch.LongTensor | None = None


@dataclass
class S4SequenceClassifierOutput(SequenceClassifierOutput):
    """`loss` includes `aux_loss` (the weighted router losses) when the model has MoE blocks."""

    aux_loss: torch.FloatTensor | None = None
    balance_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_counts: torch.LongTensor | None = None
    dropped_counts: torch.LongTensor | None = None


def _moe_fields(out) -> dict:
    return {k: out[k] if k in out else None for k in MOE_OUTPUTS}


# ----------------------------------------------------------------------------------------------------------------
# Models


class S4PreTrainedModel(SavesFoldedCode, PreTrainedModel):
    config: S4Config
    config_class = S4Config
    base_model_prefix = "backbone"
    main_input_name = "input_ids"
    _no_split_modules = ["S4Block"]
    # Float32 whatever the dtype a user loads the model in, and their own float32 FSDP unit under mixed precision:
    # the SSM parameters (Im A ~100, where bfloat16 steps by 0.5) and the MoE router (its softmax decides routing).
    # Set per model in __init__ to what its config builds (transformers checks that every name is a module).
    _keep_in_fp32_modules_strict = ["kernel", "router"]
    supports_gradient_checkpointing = True  # each block (`activation_checkpointing_enable()`)
    # As Mamba: the state cannot be rolled back to an earlier position, so generate() refuses assisted and
    # prompt-lookup decoding (which must discard rejected candidate tokens): transformers up to 5.24 by this flag,
    # S4ForCausalLM._validate_generation_mode on every version.
    _is_stateful = True

    def __init__(self, config: S4Config, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        self._keep_in_fp32_modules_strict = ["kernel"] + (["router"] if config.ffn == "moe" else [])

    def set_context_parallel(self, parallel: ContextParallel | None) -> None:
        """Read every sequence given to `forward` as this process's chunk of a longer one split across the
        processes of `parallel` (None: whole sequences again). Not saved with the model: a runtime setting, as a
        device is. Generation and carried state need whole sequences: unset it first."""
        self.base_model.context_parallel = parallel

    @torch.no_grad()
    def _init_weights(self, module):
        """Embeddings and Linears get N(0, initializer_range) from the base class; SSM parameters their structured
        init."""
        super()._init_weights(module)
        init_moe_weights(module, self.config.initializer_range)
        if isinstance(module, _SSMKernel):
            module.reset_parameters()
        elif isinstance(module, S4Layer):
            init.normal_(module.D, mean=0.0, std=1.0)  # the reference's D ~ N(0, 1)


class S4Model(S4PreTrainedModel):
    """Input encoder (token embedding, or a linear layer for `input_values` when `d_input` is set), `n_layer` S4
    blocks and a final norm (pre-norm only). -> hidden states (B, L, H)."""

    context_parallel: ContextParallel | None = None
    """Set by `set_context_parallel`: the inputs are this process's chunk of sequences split across a group."""

    def __init__(self, config: S4Config):
        super().__init__(config)
        if config.d_input is None:
            self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        else:
            self.encoder = nn.Linear(config.d_input, config.d_model)
        self._input_stats = None  # (mean, scale) on the inputs' device, made from the config when first needed
        self.layers = nn.ModuleList([S4Block(config) for _ in range(config.n_layer)])
        self.norm_f = _norm(config) if config.prenorm else nn.Identity()
        self.post_init()

    def get_input_embeddings(self):
        return getattr(self, "embeddings", None)

    def _stats(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The input statistics as float32 tensors on `device`. They live in the config, not among the weights (a
        buffer would be saved with them, or, not persistent, left uninitialised by `from_pretrained`)."""
        if self._input_stats is None or self._input_stats[0].device != device:
            self._input_stats = tuple(torch.tensor(v, dtype=torch.float32, device=device)
                                      for v in (self.config.input_mean, self.config.input_scale))
        return self._input_stats

    def set_input_embeddings(self, new_embeddings):
        self.embeddings = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        input_values: torch.Tensor | None = None,
        cache: S4Cache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        cache_params: S4Cache | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> S4ModelOutput:
        r"""
        input_values (`torch.FloatTensor` of shape `(batch_size, sequence_length, d_input)`, *optional*):
            Real-valued inputs, for a model with `d_input` set.
        attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*): 0 marks padding, whose
            SSM input reads as zero (so left padding leaves the state as no padding does). Continuing from
            `cache`, it may also cover the positions the cache has read (`seqlen_offset + sequence_length`
            columns); only the new columns are used.
        cache (`S4Cache`, *optional*): Every layer's state before the first position (None: zeros). A single
            position with a cache runs the recurrent step (O(1) per token); longer inputs run the convolution from
            that state. The positions given are the ones after those the cache has read.
        use_cache (`bool`, *optional*): Return the states after the last position in `cache` (updated in place when
            one was given). Default: `config.use_cache` when continuing from `cache`, else False (the state after a
            convolution costs a second pass over the sequence).
        output_attentions (`bool`, *optional*): Refused when True: an S4 model has no attention weights (the
            config's `output_attentions` is accepted and returns none).
        cache_params (`S4Cache`, *optional*): The name of `cache` before transformers 5.24, still accepted.
        position_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*): Documents packed into
            a row, as transformers' padding-free collators mark them: a position whose id is 0 starts a document,
            which starts from a zero state and never reads the documents before it (each is convolved on its own, in
            one batched convolution per length bucket). At the first column, 0 also drops the state a cache carries.
            Only where the ids are 0 is read.
        """
        cache = one_cache(cache, cache_params=cache_params)
        if output_attentions:  # asked by this call; `config.output_attentions` alone returns none, as Mamba does
            raise ValueError("S4 models have no attention weights: output_attentions is not supported")
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if use_cache is None:
            use_cache = self.config.use_cache and cache is not None
        # 1. Inputs -> (B, L, H): token embeddings, real-valued features (standardised, projected) or given embeddings.
        x = self._embed(input_ids, inputs_embeds, input_values)
        L = x.shape[1]
        # 2. Where the layers start: every layer's state from the cache (None: zeros) and the mask's new columns.
        states = cache.states if cache is not None and cache.has_previous_state else None
        if (use_cache or states is not None) and self.config.bidirectional:
            raise ValueError("a bidirectional S4 model reads whole sequences: it has no recurrent state")
        seen = cache.get_seq_length() if states is not None else 0
        attention_mask = self._new_columns(attention_mask, seen, L)
        if states is not None and position_ids is not None:  # a row whose first position starts a document
            fresh = position_ids[:, 0] == 0
            states = [state * ~fresh.view(-1, *[1] * (state.dim() - 1)) for state in states]
        documents = Documents.of(position_ids)  # None: one document per row, nothing to split
        rows = None
        if self.context_parallel is not None:  # this chunk's place in sequences split across processes
            if use_cache or states is not None:
                raise ValueError("a model split along the sequence (set_context_parallel) has no cache: it reads "
                                 "whole sequences split across processes; unset it to generate")
            rows = ChunkRows(self.context_parallel, None if position_ids is None else position_ids[:, 0] == 0)
        # 3. The layers: one position after a state runs the recurrent step (O(1) per token), anything longer the
        # convolution from that state. Each returns its state after the last position (when asked) and its router's
        # auxiliary outputs (an MoE feed-forward).
        all_hidden = [] if output_hidden_states else None
        if states is not None and L == 1:
            x, new_states, auxes = self._decode_one(x, cache, states, attention_mask, all_hidden)
        else:
            new_states, auxes = [], []
            for i, block in enumerate(self.layers):
                if all_hidden is not None:
                    all_hidden.append(x)
                x, state, aux = block(x, mask=attention_mask, state=states[i] if states is not None else None,
                                      return_state=bool(use_cache), documents=documents, rows=rows)
                new_states.append(state)
                auxes.append(aux)
        # 4. The final norm; the states after the last position go into the cache for the next call.
        x = self.norm_f(x)
        if all_hidden is not None:
            all_hidden.append(x)
        if use_cache:
            cache = cache if cache is not None else S4Cache()
            cache.states, cache.seqlen_offset = new_states, seen + L
        return S4ModelOutput(last_hidden_state=x, cache=cache if use_cache else None,
                             hidden_states=tuple(all_hidden) if all_hidden else None,
                             **moe_losses([a for a in auxes if a is not None], self.config))

    def _embed(self, input_ids, inputs_embeds, input_values) -> torch.Tensor:
        """Exactly one of the three inputs, as (B, L, H) hidden states."""
        if sum(t is not None for t in (input_ids, inputs_embeds, input_values)) != 1:
            raise ValueError("Specify exactly one of input_ids, inputs_embeds or input_values")
        if input_values is not None:
            if self.config.d_input is None:
                raise ValueError("input_values needs a model with d_input set; this one reads input_ids")
            if self.config.input_mean is not None:  # (B, L, d_input) raw -> standardised per feature
                mean, scale = self._stats(input_values.device)
                input_values = (input_values - mean) / scale
            return self.encoder(input_values)
        if input_ids is not None:
            if self.config.d_input is not None:
                raise ValueError(f"this model reads input_values (d_input={self.config.d_input}), not input_ids")
            return self.embeddings(input_ids)
        return inputs_embeds

    @staticmethod
    def _new_columns(attention_mask, seen: int, L: int):
        """The mask of the L new positions: a mask may also cover the `seen` positions the cache has read."""
        if attention_mask is None or attention_mask.shape[1] == L:
            return attention_mask
        if attention_mask.shape[1] != seen + L:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions: expected {L} (the new "
                             f"ones) or {seen + L} (the {seen} the cache has read, then the new ones)")
        return attention_mask[:, seen:]  # (B, L)

    def _decode_one(self, x, cache: S4Cache, states: list, attention_mask, all_hidden: list | None):
        """One position (B, 1, H) through every layer's recurrent step from `states` (the cache's); the step's
        discretised parameters are computed once per cache."""
        if cache.step_params is None:
            cache.step_params = [block.layer.kernel.step_params() for block in self.layers]
        h = x[:, 0]
        mask = attention_mask[:, 0] if attention_mask is not None else None
        new_states, auxes = [], []
        for block, state, params in zip(self.layers, states, cache.step_params):
            if all_hidden is not None:
                all_hidden.append(h[:, None])
            h, state, aux = block.step(h, state, params, mask)
            new_states.append(state)
            auxes.append(aux)
        return h[:, None], new_states, auxes


class S4ForCausalLM(S4PreTrainedModel, GenerationMixin):
    """S4 language model: `S4Model` + a linear head tied to the input embedding (unless
    `tie_word_embeddings=False`). `generate()` prefills the prompt (token ids or `inputs_embeds`) by convolution, then
    decodes one token per step with the recurrent form (`use_cache=True`, the default), in O(1) time and memory per
    token. Given the cache a previous call returned, it reads only the positions after the cache's `seqlen_offset`.
    Stateful, as Mamba: assisted and prompt-lookup decoding are refused before anything runs."""

    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}

    def __init__(self, config: S4Config):
        super().__init__(config)
        if config.bidirectional:
            raise ValueError("a causal language model cannot use bidirectional=True (it would see the future)")
        if config.d_input is not None:
            raise ValueError("a causal language model reads token ids: leave d_input unset")
        self.backbone = S4Model(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.embeddings

    def set_input_embeddings(self, new_embeddings):
        self.backbone.embeddings = new_embeddings

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        # transformers up to 5.24 refused assisted decoding for `_is_stateful` models here; 5.25 dropped that check,
        # and generate() then failed inside assisted decoding with "Assisted decoding requires a cache". The state
        # cannot be rolled back to discard rejected candidates: the same one-line refusal on every version.
        if generation_mode == GenerationMode.ASSISTED_GENERATION:
            raise ValueError(f"assisted generation is not supported with stateful models, such as "
                             f"{type(self).__name__}")
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # An SSM has no key/value cache: generate() must not build a DynamicCache; forward() builds an S4Cache.
        return False

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, cache_params=None, **kwargs):
        # generate() hands the cache over as `cache` from transformers 5.24, as `cache_params` before.
        cache = one_cache(cache, cache_params=cache_params)
        cached = cache is not None and cache.has_previous_state
        if not cached:
            next_sequence_length = None  # no state yet (prefill, or use_cache=False): read the whole sequence
        elif next_sequence_length is None:
            # The prefill of a generate() continuing from a cache. transformers trims the positions a cache has read
            # only for key/value caches, so do it here: feed the positions after the cache's `seqlen_offset`. Only
            # when the inputs are the whole sequence (embeddings, or ids as long as the mask); ids shorter than the
            # mask are only the new tokens already.
            if inputs_embeds is not None and is_first_iteration:
                total = inputs_embeds.shape[1]
            elif attention_mask is None or attention_mask.shape[1] == input_ids.shape[1]:
                total = input_ids.shape[1]
            else:
                total = None
            seen = cache.get_seq_length()
            if total is not None:
                if total <= seen:
                    raise ValueError(f"the cache has already read {seen} positions and the input has {total}: "
                                     "pass the whole sequence including at least one new token")
                next_sequence_length = total - seen
        # The cache is not handed to transformers' preparation (its keyword changed in 5.24 and it only reads key/value
        # caches) but added to the model's inputs after it.
        inputs = super().prepare_inputs_for_generation(input_ids, next_sequence_length=next_sequence_length,
                                                       attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                                       is_first_iteration=is_first_iteration, **kwargs)
        if cache is not None:
            inputs["cache"] = cache
        if cached and not is_first_iteration:
            inputs["attention_mask"] = None  # decoding: generated tokens are never padding
        return inputs

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: S4Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: torch.Tensor | int | None = None,
        cache_params: S4Cache | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> S4CausalLMOutput:
        r"""
        cache (`S4Cache`, *optional*): Every layer's recurrent state before the first position (see `S4Model`).
        use_cache (`bool`, *optional*): Return every layer's state after the last position in `cache`.
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets, usually `input_ids`; shifted inside (position t predicts t+1); -100 is ignored.
        logits_to_keep (`int`): compute logits only for the last `logits_to_keep` positions (0 = all).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            When given, the loss is `sum of token losses / num_items_in_batch` rather than a mean over this batch, so
            a trainer can normalise by the real token count of a whole accumulation window across processes.
        cache_params (`S4Cache`, *optional*): The name of `cache` before transformers 5.24, still accepted.
        position_ids (`torch.LongTensor`, *optional*): Packed documents, each read on its own (see `S4Model`).
        kwargs: Passed on to `self.loss_function`, e.g. `shift_labels` (targets already shifted, as context-parallel
            training gives them) or `ignore_index`.
        """
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            cache=one_cache(cache, cache_params=cache_params),
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            position_ids=position_ids,
            return_dict=True,
        )
        hidden = out.last_hidden_state  # (B, L, H)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # (B, L, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=num_items_in_batch, **kwargs)
            if out.aux_loss is not None:
                loss = loss + out.aux_loss
        return S4CausalLMOutput(loss=loss, logits=logits, cache=out.cache,
                                hidden_states=out.hidden_states, **_moe_fields(out))


class S4ForSequenceClassification(S4PreTrainedModel):
    """`S4Model` + pooling over time (`config.pooling`: mean over real steps, or the last real step) + a linear head.
    `num_labels == 1` is regression (MSE); otherwise classification (cross-entropy), or multi-label with
    `problem_type="multi_label_classification"`, following transformers' `problem_type`."""

    def __init__(self, config: S4Config):
        super().__init__(config)
        if config.d_input is not None:
            self.main_input_name = "input_values"  # real-valued sequences, no token embedding
        self.num_labels = config.num_labels
        self.backbone = S4Model(config)
        self.score = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def set_input_embeddings(self, new_embeddings):
        self.backbone.set_input_embeddings(new_embeddings)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        input_values: torch.FloatTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs,
    ) -> S4SequenceClassifierOutput:
        r"""
        input_values (`torch.FloatTensor` of shape `(batch_size, sequence_length, d_input)`, *optional*):
            Real-valued inputs (a model with `d_input` set); otherwise `input_ids`.
        attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*): 1 for real steps, 0 for
            padding (right-padded sequences of different lengths); pooling ignores padding.
        labels (`torch.Tensor` of shape `(batch_size,)`): class ids, or targets for regression.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): When given, the loss is the sum of the per-sequence
            losses divided by this count (a trainer's sequences in a whole accumulation window across processes).
        """
        out = self.backbone(input_ids=input_ids, input_values=input_values, inputs_embeds=inputs_embeds,
                            attention_mask=attention_mask, output_hidden_states=output_hidden_states,
                            output_attentions=output_attentions, return_dict=True)
        h = out.last_hidden_state  # (B, L, H)
        if attention_mask is None:
            attention_mask = torch.ones(h.shape[:2], dtype=h.dtype, device=h.device)
        mask = attention_mask.to(h.dtype)
        parallel = self.backbone.context_parallel
        pooled = self._pool(h, mask) if parallel is None else self._pool_split(h, mask, parallel)
        logits = self.score(pooled)  # (B, num_labels)
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels, num_items_in_batch)
            if out.aux_loss is not None:
                loss = loss + out.aux_loss
        return S4SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                          **_moe_fields(out))

    def _pool(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, L, H) -> (B, H): the mean over real steps, or the last real step (the highest index with mask 1)."""
        if self.config.pooling == "mean":
            return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        positions = torch.arange(h.shape[1], device=h.device)
        last = (mask * positions).argmax(1)
        return h[torch.arange(h.shape[0], device=h.device), last]

    def _pool_split(self, h: torch.Tensor, mask: torch.Tensor, parallel: ContextParallel) -> torch.Tensor:
        """`_pool` over sequences whose chunks lie on the processes of `parallel`, the same on each: sums over the
        group (the mean), or the last real step from the process that holds it."""
        B, L = mask.shape
        if self.config.pooling == "mean":
            sums = parallel.all_reduce(torch.cat([(h * mask[..., None]).sum(1), mask.sum(1, keepdim=True)], -1))
            return sums[:, :-1] / sums[:, -1:].clamp(min=1)
        positions = torch.arange(L, device=h.device) + parallel.rank * L  # in the whole sequence
        real = mask > 0
        last = torch.where(real, positions, -1).amax(1)  # (B,) -1: no real step in this chunk
        last = parallel.max(last).clamp(min=0)  # a row without real steps pools its first step, as `_pool` does
        mine = (last >= parallel.rank * L) & (last < (parallel.rank + 1) * L)
        picked = h[torch.arange(B, device=h.device), (last - parallel.rank * L).clamp(0, L - 1)]
        return parallel.all_reduce(picked * mine[:, None].to(h.dtype))

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        reduction = "mean" if num_items_in_batch is None else "sum"
        if self.config.problem_type == "regression":
            loss = nn.functional.mse_loss(logits.squeeze(-1).float(), labels.float(), reduction=reduction)
        elif self.config.problem_type == "single_label_classification":
            loss = nn.functional.cross_entropy(logits.float(), labels.view(-1), reduction=reduction)
        else:
            loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
            loss = loss.mean() if num_items_in_batch is None else loss.mean(-1).sum()
        return loss if num_items_in_batch is None else loss / num_items_in_batch


__all__ = ["S4PreTrainedModel", "S4Model", "S4ForCausalLM", "S4ForSequenceClassification", "S4Cache"]

# save_pretrained copies this file and its relative imports next to the weights and writes `auto_map`, so
# `AutoModel*.from_pretrained(path, trust_remote_code=True)` works where s4accel is not installed.
S4Config.register_for_auto_class()
S4Model.register_for_auto_class("AutoModel")
S4ForCausalLM.register_for_auto_class("AutoModelForCausalLM")
S4ForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
