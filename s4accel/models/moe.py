"""Mixture-of-experts feed-forward layer, shared by `MoEForCausalLM` and the S4 blocks (`S4Config.ffn="moe"`).

Notation: `T` tokens of width `D` (`d_model`), `E` experts (`num_experts`) of hidden width `F` (`d_ffn`), each token
routed to `k` experts (`num_experts_per_tok`). Per token `x`:

    logits = W_r x                      (E,), in float32 whatever the autocast dtype
    p = softmax(logits);  (w, e) = top-k of p, renormalised to sum 1 when `norm_topk_prob`
    y = sum_j w_j SwiGLU_{e_j}(x)  [+ SwiGLU_shared(x)]
    SwiGLU_e(x) = down_proj[e] (silu(gate) * up),  (gate, up) = gate_up_proj[e] x

Dispatch sorts the `T k` (token, expert) pairs by expert so that each expert runs one matmul on a contiguous slice.
Three ways to run the experts over those slices (`moe_dispatch`), all giving the same values and gradients:

- `grouped_mm`: `torch.nn.functional.grouped_mm` over all slices at once (the default on CUDA, in bf16 and float32,
  where it is one kernel), on rows laid out by `static_layout` in sizes fixed by T, k and E: nothing in the forward
  or backward waits for the GPU to say how many pairs each expert got, and each token's k results are gathered back
  and summed in a fixed order (eagerly on CUDA those sums, the weighted SwiGLU, and the float32 router with the
  experts' cast of its input are Triton kernels: moe_kernels.py);
- `fused` (the default elsewhere): the pairs go through in windows of a few thousand rows; per window one matmul per
  expert slice into a window-sized buffer, with the gather, activation, routing weight and scatter-add on rows that
  are still in cache, and a hand-written backward (`SwiGLUExpertsFunction`) that writes each expert's weight gradient
  in place instead of stacking E of them. It keeps a third of the activations the other two keep for backward, and
  on 2 CPU cores it is within a few percent of their speed (bench/moe.py);
- `loop`: the same per-slice matmuls under plain autograd, the slow obviously-correct reference the others are
  tested against.

Every expert's slice is padded to a multiple of `EXPERT_ROWS` rows (pairs of weight 0), and every matmul over the
pairs has such a row count. A BLAS rounds a row of a product differently depending on how many rows the product has
(one row takes a matrix-vector kernel; with the weight transposed, fewer than 16 rows another kernel again), and which
tokens share an expert's matmul depends on every token's routing: without the padding, a token's output would move
by rounding when another token (another document of a packed block, another sequence of the batch) changes. With
it, a token's output is bit for bit the same whatever else is in the batch (checked on MKL here: results are the same
for every multiple of 16 rows). It costs at most `EXPERT_ROWS - 1` rows per expert and layer.

With `capacity_factor` set, an expert takes at most `ceil(capacity_factor T k / E)` pairs; first choices are served
before second choices, each in token order. A dropped pair contributes nothing; a token whose pairs are all dropped
gets a zero output, so the residual connection around the layer passes it through unchanged.

This file is copied into Hub repositories for `trust_remote_code` loading: it imports only torch and its sibling
moe_kernels.py (which imports Triton where it is installed).
"""

import functools
import math
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from .moe_kernels import moe_kernels_run, pair_sums, route_and_cast, router_kernel_takes, swiglu_weighted

DISPATCHES = ("auto", "grouped_mm", "fused", "loop")
_CHUNK_BYTES = 4 * 2**20  # size of the `fused` path's largest per-chunk buffer: in cache, and well under glibc's
# mmap threshold, so the buffers are recycled between steps instead of being page-faulted in again (s4accel.allocator)
EXPERT_ROWS = 16  # every expert matmul has a multiple of this many rows: a token's result never depends on the others
# Where an eager `grouped_mm` layer compiles its routing (`routing`: softmax, top-k, `static_layout`, the losses;
# inductor, dynamic shapes, once per E, k and renormalisation): "cuda" on CUDA devices, "always" everywhere (tests),
# "never" nowhere. Eager, those are about a hundred operations on tensors of T x E values per forward and backward,
# each a kernel launch a GPU may wait for (bench/launches.py counts them: `moe/routing`); compiled, a few kernels.
# Inside an outer `torch.compile` the routing is traced with the rest instead. Where compiling fails, one warning and
# eager routing. "cuda" by default: on an H200 (bench/results/2026-11-28-gpu-speed-NVIDIA-H200-e1664d1.md, one run)
# the E 8, k 2 layer at 32K tokens took 8.12 ms with its routing compiled against 8.76 eager (the routing alone 2.22
# against 2.97); E 128, k 8 26.92 against 27.06. The first step pays the compilation (about 15 s there).
COMPILE_ROUTING = "cuda"
# Where an eager `grouped_mm` layer compiles its routing and its experts together (`routed_experts`: the routing
# above, the gathers, both grouped matmuls, the activation and the k-way sums, one graph; the router's matmul and
# jitter stay eager, so that the jitter's random numbers are eager's): the same modes, in bf16 only (grouped_mm does
# not compile in float32: grouped_mm_traceable). Where it compiles, it takes the place of COMPILE_ROUTING. "never"
# by default until a GPU has timed it: on an H200 the layer compiled whole (bench/gpu_speed.py's `moe_compiled`) took
# 5.39 ms at E 8, k 2 against 8.12 with only its routing compiled.
COMPILE_EXPERTS = "never"
_ROUTING_FAILED = []  # the first failure's message, once one happened: routing stays eager from then on
_EXPERTS_FAILED = []  # the same for COMPILE_EXPERTS


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss `E sum_e f_e P_e` over the (unmasked) tokens.

    probs (T, E): router softmax; experts (T, k): chosen experts; mask (T,) bool: real tokens (None: all).
    `f_e` = (pairs routed to e) / T, `P_e` = mean router probability of e. As in transformers' Mixtral it equals
    `k` under perfectly uniform routing (`f_e = k/E`, `P_e = 1/E`) and grows to `E` when one expert takes every
    token with probability 1 (top-1).
    """
    # Masked sums rather than `probs[mask]`, and `scatter_add_` rather than `bincount`: both of those wait for the GPU
    # (a boolean index's size, bincount's largest value), and the forward of a training step never has to.
    if probs.shape[0] == 0:
        return probs.new_zeros(())
    T, k = experts.shape
    real = torch.ones(T, dtype=probs.dtype, device=probs.device) if mask is None else mask.to(probs.dtype)  # (T,)
    n = real.sum().clamp(min=1)
    f = probs.new_zeros(num_experts).scatter_add_(0, experts.reshape(-1), real.repeat_interleave(k)) / n  # no grad
    p = probs if mask is None else torch.where(mask[:, None], probs, 0)  # where: a padding row's NaN stays out
    return num_experts * (f * p.sum(0) / n).sum()


def router_z_loss(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss `mean(logsumexp(logits)^2)` over the (unmasked) tokens: keeps router logits small."""
    z = torch.logsumexp(logits, dim=-1) ** 2  # (T,)
    if mask is None:
        return z.mean() if z.numel() else logits.new_zeros(())
    # A masked mean (no boolean index, which would wait for the GPU); where, so a padding row's NaN stays out
    return torch.where(mask, z, 0).sum() / mask.sum().clamp(min=1)


def group_router_losses(probs: torch.Tensor, experts: torch.Tensor, logits: torch.Tensor, num_experts: int,
                        mask: torch.Tensor | None, parallel) -> tuple[torch.Tensor, torch.Tensor]:
    """`load_balancing_loss` and `router_z_loss` over the tokens of a whole group of processes (context
    parallelism: the rest of each sequence is on the others): the sums they are made of, summed over the group in
    one collective."""
    if mask is not None:
        probs, experts, logits = probs[mask], experts[mask], logits[mask]
    E = num_experts
    counts = torch.bincount(experts.reshape(-1), minlength=E).to(probs.dtype)  # no gradient, as f_e has none
    z = torch.logsumexp(logits, dim=-1) ** 2
    sums = parallel.all_reduce(torch.cat([probs.sum(0), z.sum()[None], counts, probs.new_full((1,), len(probs))]))
    n = sums[-1].clamp(min=1)
    return E * (sums[E + 1: 2 * E + 1] / n * (sums[:E] / n)).sum(), sums[E] / n


def pad_slices(token: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor,
               rows: int = EXPERT_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad each expert's slice of the pairs sorted by expert to a multiple of `rows` with pairs (token 0, weight 0),
    which add exactly nothing: token (P,), weight (P,), expert (P,) sorted, counts (E,) -> token (P',), weight (P',),
    counts (E,), P' = sum of the padded counts. The weights keep their gradient (the padding's is dropped)."""
    padded = (counts + rows - 1) // rows * rows  # (E,)
    starts, new_starts = counts.cumsum(0) - counts, padded.cumsum(0) - padded
    dest = new_starts[expert] + torch.arange(token.shape[0], device=token.device) - starts[expert]  # (P,)
    total = int(padded.sum())  # a host sync, as the dispatch's own split sizes are
    return (token.new_zeros(total).index_copy(0, dest, token), weight.new_zeros(total).index_copy(0, dest, weight),
            padded)


def static_layout(experts: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None, capacity: int | None,
                  num_experts: int, rows: int = EXPERT_ROWS) -> tuple[torch.Tensor, ...]:
    """The pairs laid out for `grouped_mm` in tensors whose sizes depend only on T, k and E, so that nothing in a
    forward or backward waits for the GPU (the other dispatches need each expert's count on the host).

    experts, weights (T, k): each token's choices; valid (T,) bool or None: real tokens; capacity: pairs an expert
    takes at most (None: no limit). Returns
      token (R,): the token of each row, R = ceil((T k + E (rows - 1)) / rows) rows;
      offs (E,) int32: the end of each expert's rows, every slice padded to a multiple of `rows` (rows of token 0 that
        no pair reads) and the last expert's running to R;
      pair_row (k T,): the row of each pair, slot-major (every first choice, then every second choice, ...); a pair
        dropped by capacity or of a padding token has the last row, R - 1, which no kept pair uses when any pair is
        dropped or masked;
      row_weight (R,): the routing weight of each row's pair, 0 for the padding rows and the last row (a kept pair's
        weight keeps its gradient);
      counts (E,): pairs routed to each expert, real tokens, before capacity; dropped (): pairs dropped by capacity.
    Rows are ordered as in the other dispatches: by expert, first choices first, each in token order."""
    T, k = experts.shape
    E, P = num_experts, T * k
    R = -(-(P + E * (rows - 1)) // rows) * rows
    key = experts.t().reshape(-1)  # (P,), slot-major
    if valid is not None:  # padding goes to a sentinel expert E, after every real one
        key = torch.where(valid.repeat(k), key, E)
    order = torch.sort(key, stable=True).indices  # (P,)
    sorted_key = key[order]
    all_counts = torch.zeros(E + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    counts = all_counts[:E]
    rank = torch.arange(P, device=key.device) - (all_counts.cumsum(0) - all_counts)[sorted_key]  # place in its slice
    fits = sorted_key < E
    kept, dropped = counts, counts.new_zeros(())
    if capacity is not None:
        fits = fits & (rank < capacity)
        kept = counts.clamp(max=capacity)
        dropped = (counts - kept).sum()
    padded = (kept + rows - 1) // rows * rows  # (E,)
    starts = padded.cumsum(0) - padded
    dest = torch.where(fits, starts[sorted_key.clamp(max=E - 1)] + rank, R - 1)  # (P,) row of each sorted pair
    token = torch.zeros(R, dtype=torch.long, device=key.device).scatter_(0, dest, torch.where(fits, order % T, 0))
    pair_row = torch.empty_like(dest).scatter_(0, order, dest)
    row_weight = weights.new_zeros(R).scatter(0, dest, torch.where(fits, weights.t().reshape(-1)[order], 0))
    offs = padded.cumsum(0)
    offs[-1:].fill_(R)  # fill_ takes the number as an argument: `offs[-1] = R` copies it from the host, a sync
    return token, offs.to(torch.int32), pair_row, row_weight, counts, dropped


def top_k_routes(logits: torch.Tensor, k: int, norm_topk_prob: bool):
    """Router logits (T, E) -> softmax probabilities (T, E) and each token's k largest as weights and experts (T, k),
    the weights renormalised to sum 1 when `norm_topk_prob`."""
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def routing(logits: torch.Tensor, valid: torch.Tensor | None, capacity: int | None, num_experts: int, k: int,
            norm_topk_prob: bool) -> tuple:
    """The `grouped_mm` dispatch's routing from the router logits (T, E): `static_layout`'s rows (token, offs,
    pair_row, row_weight), counts, dropped, then the load-balancing and z losses. One graph for `torch.compile` where
    `COMPILE_ROUTING` says."""
    probs, weights, experts = top_k_routes(logits, k, norm_topk_prob)
    *rows, counts, dropped = static_layout(experts, weights, valid, capacity, num_experts)
    return (tuple(rows), counts, dropped, load_balancing_loss(probs, experts, num_experts, valid),
            router_z_loss(logits, valid))


@functools.lru_cache
def _compiled_routing(num_experts: int, k: int, norm_topk_prob: bool):
    return torch.compile(functools.partial(routing, num_experts=num_experts, k=k, norm_topk_prob=norm_topk_prob),
                         dynamic=True, fullgraph=True)


def compiles_here(mode: str, failed: list, x: torch.Tensor) -> bool:
    """Whether a COMPILE_ROUTING / COMPILE_EXPERTS `mode` compiles for `x`: never inside an outer compile (which
    traces the eager code anyway), nor after compiling once failed."""
    return (mode == "always" or mode == "cuda" and x.is_cuda) and not failed and not torch.compiler.is_compiling()


def compiled_or_eager(what: str, failed: list, compiled, eager, *args):
    """`compiled(*args)`, or, where compiling fails (a compiler missing, an unsupported torch), one warning (`what`
    runs eagerly, and why) and `eager(*args)` from then on (a real error repeats there)."""
    try:
        return compiled(*args)
    except Exception as e:
        failed.append(f"{type(e).__name__}: {e}".splitlines()[0][:300])
        warnings.warn(f"{what} eagerly: compiling it failed ({failed[0]})", stacklevel=3)
        return eager(*args)


def route_eagerly_or_compiled(logits: torch.Tensor, valid: torch.Tensor | None, capacity: int | None,
                              num_experts: int, k: int, norm_topk_prob: bool) -> tuple:
    """`routing`, compiled where `COMPILE_ROUTING` says."""
    eager = functools.partial(routing, num_experts=num_experts, k=k, norm_topk_prob=norm_topk_prob)
    if not compiles_here(COMPILE_ROUTING, _ROUTING_FAILED, logits):
        return eager(logits, valid, capacity)
    return compiled_or_eager("MoE routing runs", _ROUTING_FAILED, _compiled_routing(num_experts, k, norm_topk_prob),
                             eager, logits, valid, capacity)


class _GatherRows(torch.autograd.Function):
    """`x (T, D)` -> the rows `x[token] (R, D)` of `static_layout`; backward: each token's gradient is the sum of
    its k pairs' rows (`pair_row`), gathered, in slot order. Exact: every other row (padding rows, the last row of
    dropped pairs) has a zero gradient, as its routing weight is 0."""

    @staticmethod
    def forward(ctx, x, token, pair_row):
        ctx.save_for_backward(pair_row)
        ctx.T = x.shape[0]
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, g):
        (pair_row,) = ctx.saved_tensors
        return _sum_rows(g, pair_row, ctx.T), None, None


def _sum_rows(src: torch.Tensor, pair_row: torch.Tensor, T: int) -> torch.Tensor:
    """`src (R, D)` -> each token's k rows `pair_row (k T,)` summed, in slot order: `(T, D)`."""
    if moe_kernels_run(src):
        return pair_sums(src, pair_row, T)
    return src.index_select(0, pair_row).view(-1, T, src.shape[1]).sum(0)


class _SumPairs(torch.autograd.Function):
    """`y (R, D)` -> `out[t] = sum_j y[pair_row[j T + t]]` (T, D), in slot order; backward: each row's gradient is its
    token's (`token`), gathered. Exact for every row a pair reads once (each kept pair has a row of its own); the
    other rows' outputs are zeros (routing weight 0), and what reaches them moves no weight: their activations are
    zeros too, and their weights' gradients are dropped where the weights are made (static_layout)."""

    @staticmethod
    def forward(ctx, y, pair_row, token, T: int):
        ctx.save_for_backward(token)
        return _sum_rows(y, pair_row, T)

    @staticmethod
    def backward(ctx, g):
        (token,) = ctx.saved_tensors
        return g.index_select(0, token), None, None, None


def resolve_dispatch(dispatch: str, x: torch.Tensor) -> str:
    """The dispatch an input runs: `auto` made concrete."""
    if dispatch != "auto":
        return dispatch
    return "grouped_mm" if _grouped_mm_pays(x) else "fused"


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts multiply in: autocast's where it is on (`MoEExperts._operands`), else x's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _grouped_mm_pays(x: torch.Tensor) -> bool:
    """Where `grouped_mm` is the fastest: CUDA (compute capability >= 8) in bf16 or float32. Measured on an H200 (one
    layer, 8,192 tokens, d_model 512, experts 1,024 wide, E = 8, k = 2, forward + backward): 3.4 ms against 10.2 ms
    for `fused` in bf16, 7.4 against 19.2 ms in float32. (PyTorch's one-kernel form, without a host sync, is bf16 on
    sm_90/sm_100; float32, fp16 and older GPUs take its fallback, a matmul per group after copying `offs` to the
    host, which the float32 figure is.) On CPU it runs a matmul per group anyway, under autograd's bookkeeping;
    `fused` is within a few percent of it there and keeps a third of the activations."""
    return (hasattr(F, "grouped_mm") and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float32)
            and grouped_mm_traceable(compute_dtype(x)) and torch.cuda.get_device_capability(x.device)[0] >= 8)


def grouped_mm_traceable(dtype: torch.dtype, compiling: bool | None = None) -> bool:
    """Whether `grouped_mm` in `dtype` can run here: eagerly, yes; under `torch.compile` in bf16 alone (its
    fake-tensor check refuses float32, torch 2.11 to 2.13: tests/models/test_moe.py keeps that premise). So a
    compiled float32 layer takes `fused` (which breaks the graph at its host sync) instead of failing to compile."""
    compiling = torch.compiler.is_compiling() if compiling is None else compiling
    return dtype == torch.bfloat16 or not compiling


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU feed-forward: (..., D) -> (..., D) through hidden width F."""

    def __init__(self, d_model: int, d_ffn: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(d_model, 2 * d_ffn, bias=False)
        self.down_proj = nn.Linear(d_ffn, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _chunks(sizes: list[int], rows: int) -> list[tuple[int, int, list[int], list[int]]]:
    """Cut the P pairs, sorted by expert with `sizes[e]` pairs for expert `e`, into windows of `rows` rows (the last
    may be shorter). Returns [(start, end, experts, counts)]: the experts whose slices meet `start:end`, in order, and
    how many of its rows each has there. An expert's slice may run over several windows; idle experts never appear."""
    out, experts, counts, start, filled = [], [], [], 0, 0
    for e, n in enumerate(sizes):
        while n > 0:
            take = min(n, rows - filled)
            experts.append(e)
            counts.append(take)
            n, filled = n - take, filled + take
            if filled == rows:
                out.append((start, start + rows, experts, counts))
                start, filled, experts, counts = start + rows, 0, [], []
    if experts:
        out.append((start, start + filled, experts, counts))
    return out


class SwiGLUExpertsFunction(torch.autograd.Function):
    """`out[t] = sum_p w_p SwiGLU_{e_p}(x[t])` over the pairs `p` of token `t`, pairs sorted by expert.

    forward(x (T, D), gate_up (E, 2F, D), down (E, D, F), token (P,), weight (P,), sizes [E ints]) -> (T, D), all
    floating tensors of one dtype. The pairs are processed in windows of a few thousand rows (`_chunks`,
    `_CHUNK_BYTES`): per window, gather the inputs, one matmul per expert slice written into the window's buffer,
    activation and routing weight, one matmul per slice, scatter-add. Every buffer is window-sized, so it is in cache
    while used and is recycled by the allocator from one step to the next, whatever the batch size. Saved for
    backward, per window: the pre-activations (n, 2F) and `silu(gate)` (n, F); the inputs are gathered again and
    `silu(gate) * up` recomputed, cheaper than storing them. The backward writes each expert's weight gradient in
    place (accumulating where its slice spans windows). Autocast is off inside: the caller casts.
    """

    @staticmethod
    def forward(ctx, x, gate_up, down, token, weight, sizes):
        with torch.autocast(device_type=x.device.type, enabled=False):
            D, Fh = x.shape[1], down.shape[-1]
            rows = _CHUNK_BYTES // (2 * Fh * x.element_size()) // EXPERT_ROWS * EXPERT_ROWS  # whole tiles per window
            chunks = _chunks(sizes, max(EXPERT_ROWS, rows))
            R = max((end - start for start, end, _, _ in chunks), default=0)
            x_buf, a_buf, y_buf = x.new_empty(R, D), x.new_empty(R, Fh), x.new_empty(R, D)  # scratch, every window
            gate_up_t, down_t = gate_up.transpose(1, 2).unbind(0), down.transpose(1, 2).unbind(0)  # (D, 2F), (F, D)
            out, saved = torch.zeros_like(x), []
            for start, end, experts, n_e in chunks:
                n, tok = end - start, token[start:end]
                xc = torch.index_select(x, 0, tok, out=x_buf[:n])
                h = x.new_empty(n, 2 * Fh)  # (gate | up) pre-activations, saved
                for xe, he, e in zip(xc.split(n_e), h.split(n_e), experts):
                    torch.mm(xe, gate_up_t[e], out=he)
                sg = F.silu(h[:, :Fh])  # saved
                aw = torch.mul(sg, h[:, Fh:], out=a_buf[:n]).mul_(weight[start:end, None])  # w (silu(gate) * up)
                y = y_buf[:n]
                for ae, ye, e in zip(aw.split(n_e), y.split(n_e), experts):
                    torch.mm(ae, down_t[e], out=ye)
                out.index_add_(0, tok, y)
                saved += [h, sg]
        ctx.save_for_backward(x, gate_up, down, token, weight, *saved)
        ctx.chunks, ctx.idle = chunks, [e for e, n in enumerate(sizes) if n == 0]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, gate_up, down, token, weight, *saved = ctx.saved_tensors
        Fh, chunks = down.shape[-1], ctx.chunks
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            grad_x = torch.zeros_like(x)
            grad_gate_up, grad_down = torch.empty_like(gate_up), torch.empty_like(down)  # every block written below
            grad_weight = torch.empty_like(weight)
            R = max((end - start for start, end, _, _ in chunks), default=0)
            gy_buf, x_buf, gx_buf = (x.new_empty(R, x.shape[1]) for _ in range(3))
            ga_buf, act_buf, gh_buf = x.new_empty(R, Fh), x.new_empty(R, Fh), x.new_empty(R, 2 * Fh)
            gate_ups, downs = gate_up.unbind(0), down.unbind(0)  # (2F, D), (D, F)
            grad_gate_ups, grad_downs = grad_gate_up.unbind(0), grad_down.unbind(0)
            written = set()  # experts whose weight gradient holds a first window's part

            def weight_grad(e, out, a, b):  # out = a @ b, or out += a @ b where an earlier window started it
                if e in written:
                    out.addmm_(a, b)
                else:
                    torch.mm(a, b, out=out)

            for i, (start, end, experts, n_e) in enumerate(chunks):
                n, tok, w = end - start, token[start:end], weight[start:end, None]
                h, sg = saved[2 * i], saved[2 * i + 1]
                gate, up = h[:, :Fh], h[:, Fh:]
                gy = torch.index_select(grad_out, 0, tok, out=gy_buf[:n])  # (n, D)
                gys, ga = gy.split(n_e), ga_buf[:n]  # ga: gradient of w * act
                for gye, gae, e in zip(gys, ga.split(n_e), experts):
                    torch.mm(gye, downs[e], out=gae)
                act = torch.mul(sg, up, out=act_buf[:n])
                grad_weight[start:end] = torch.linalg.vecdot(ga, act)
                aw = act.mul_(w)
                for gye, awe, e in zip(gys, aw.split(n_e), experts):
                    weight_grad(e, grad_downs[e], gye.t(), awe)  # (D, F)
                ga.mul_(w)  # now the gradient of act
                gh = gh_buf[:n]
                torch.mul(ga, sg, out=gh[:, Fh:])
                torch.ops.aten.silu_backward.grad_input(ga.mul_(up), gate, grad_input=gh[:, :Fh])
                xc, gx = torch.index_select(x, 0, tok, out=x_buf[:n]), gx_buf[:n]
                for ghe, xe, gxe, e in zip(gh.split(n_e), xc.split(n_e), gx.split(n_e), experts):
                    weight_grad(e, grad_gate_ups[e], ghe.t(), xe)  # (2F, D)
                    torch.mm(ghe, gate_ups[e], out=gxe)
                grad_x.index_add_(0, tok, gx)
                written.update(experts)
            for e in ctx.idle:  # experts without pairs: zero gradient, as autograd gives
                grad_gate_up[e].zero_()
                grad_down[e].zero_()
        return grad_x, grad_gate_up, grad_down, None, grad_weight, None


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, token: torch.Tensor,
                    offs: torch.Tensor, pair_row: torch.Tensor, row_weight: torch.Tensor) -> torch.Tensor:
    """The `grouped_mm` dispatch on `static_layout`'s rows: x (T, D) -> (T, D), no host sync; `gate_up (E, 2F, D)`
    and `down (E, D, F)` in x's dtype. The routing weight scales each row's activation (F wide, before the down
    projection: fewer elements than its D-wide output); the rows are gathered from the tokens and summed back per
    token by gathers both ways, forward and backward, so no step adds atomically (measured on an H100: the atomic
    index_add_ of the plain gathers' backward took a quarter of the layer) and the sums run in a fixed order."""
    xs = _GatherRows.apply(x, token, pair_row)  # (R, D), sorted by expert
    h = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # (R, 2F): (gate | up)
    if moe_kernels_run(h):
        act = swiglu_weighted(h, row_weight)
    else:
        gate, up = h.chunk(2, dim=-1)  # (R, F) each
        act = F.silu(gate) * up * row_weight.to(x.dtype)[:, None]
    y = F.grouped_mm(act, down.transpose(1, 2), offs=offs)  # (R, D); rows of weight 0 are exact zeros
    return _SumPairs.apply(y, pair_row, token, x.shape[0])


def routed_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, logits: torch.Tensor,
                   valid: torch.Tensor | None, capacity: int | None, num_experts: int, k: int,
                   norm_topk_prob: bool) -> tuple:
    """`routing` then `grouped_experts`: (out (T, D), counts, dropped, balance loss, z loss). One graph for
    `torch.compile` where `COMPILE_EXPERTS` says."""
    rows, counts, dropped, balance, z = routing(logits, valid, capacity, num_experts, k, norm_topk_prob)
    return grouped_experts(x, gate_up, down, *rows), counts, dropped, balance, z


@functools.lru_cache
def _compiled_routed_experts(num_experts: int, k: int, norm_topk_prob: bool):
    return torch.compile(functools.partial(routed_experts, num_experts=num_experts, k=k,
                                           norm_topk_prob=norm_topk_prob), dynamic=True, fullgraph=True)


class MoEExperts(nn.Module):
    """E SwiGLU experts stored as 3-D weights.

    forward(x (T, D), token (P,), weight (P,), counts (E,)) -> (T, D): `out[t] = sum_p weight_p SwiGLU_{e_p}(x[t])`
    over the pairs `p` with `token_p = t`, where the P pairs are sorted by expert and `counts[e]` of them go to
    expert `e` (the `fused` and `loop` dispatches). Tokens without a pair get zero.
    forward(x, rows=(token, offs, pair_row, row_weight)) -> (T, D): the same sum for `grouped_mm`, on
    `static_layout`'s rows.
    forward(x, routed=(logits, valid, capacity, E, k, norm_topk_prob)) -> (out, counts, dropped, balance loss, z loss):
    the routing and the `grouped_mm` sum together (`routed_experts`, compiled where `COMPILE_EXPERTS` says).
    """

    def __init__(self, num_experts: int, d_model: int, d_ffn: int, dispatch: str = "auto"):
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        self.dispatch = dispatch
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * d_ffn, d_model))  # (E, 2F, D)
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, d_ffn))  # (E, D, F)

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if torch.is_autocast_enabled(x.device.type):  # grouped_mm and the 3-D weights are not autocast by torch
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return x, self.gate_up_proj.to(x.dtype), self.down_proj.to(x.dtype)

    def forward(self, x: torch.Tensor, token: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                counts: torch.Tensor | None = None, rows: tuple | None = None, routed: tuple | None = None):
        # One entry point for every layout, so that a wrapper of this module (PEFT's LoRA on the 3-D weights, which
        # patches them during the wrapped forward) sees every dispatch.
        x, gate_up, down = self._operands(x)
        if rows is not None:  # static_layout's rows: the grouped_mm dispatch
            return grouped_experts(x, gate_up, down, *rows)
        if routed is not None:  # (logits, valid, capacity, E, k, norm_topk_prob): routed_experts' arguments
            logits, valid, capacity, E, k, norm = routed
            eager = functools.partial(routed_experts, num_experts=E, k=k, norm_topk_prob=norm)
            if not compiles_here(COMPILE_EXPERTS, _EXPERTS_FAILED, x):
                return eager(x, gate_up, down, logits, valid, capacity)
            return compiled_or_eager("The MoE experts and their routing run", _EXPERTS_FAILED,
                                     _compiled_routed_experts(E, k, norm), eager, x, gate_up, down, logits, valid,
                                     capacity)
        weight = weight.to(x.dtype)
        if token.shape[0] == 0:  # no pair at all (all padding): the weights still join the graph, with zero gradient
            return x.new_zeros(x.shape) + 0 * (gate_up.sum() + down.sum())
        if resolve_dispatch(self.dispatch, x) == "fused":
            return SwiGLUExpertsFunction.apply(x, gate_up, down, token, weight, counts.tolist())  # one host sync
        # the loop (grouped_mm runs on static_layout's rows, above)
        xs = x.index_select(0, token)  # (P, D), sorted by expert
        out = []
        # unbind, not gate_up[e]: the backward of E separate index ops would build E full-size (E, 2F, D) gradients
        for xe, w1, w2 in zip(xs.split(counts.tolist()), gate_up.unbind(0), down.unbind(0)):  # one host sync
            gate, up = F.linear(xe, w1).chunk(2, dim=-1)
            out.append(F.linear(F.silu(gate) * up, w2))
        return x.new_zeros(x.shape).index_add_(0, token, torch.cat(out) * weight[:, None])


class MoERouter(nn.Linear):
    """The router, `Linear(d_model, E, bias=False)` in float32. `forward(x, cast=dtype)`: `(logits, x in dtype)` from
    one read of a float32 x (moe_kernels.route_and_cast; only where `router_kernel_takes`), still through the module,
    so that an FSDP unit of its own gathers the weight first."""

    def forward(self, x: torch.Tensor, cast: torch.dtype | None = None):
        return super().forward(x) if cast is None else route_and_cast(x, self.weight, cast)


class MoELayer(nn.Module):
    """Router, top-k SwiGLU experts and optional shared experts: forward(x (B, L, D), mask (B, L)) -> (y, aux).

    `aux` holds this layer's `router_logits (T, E)`, `balance_loss`, `z_loss`, `expert_counts (E,)` (pairs routed
    to each expert, real tokens only, before capacity) and `dropped (,)` (pairs dropped by capacity).
    `config` needs `num_experts`, `top_k`, `d_ffn`, `norm_topk_prob`, `router_jitter`, `capacity_factor`,
    `num_shared_experts`, `moe_dispatch`.
    """

    def __init__(self, config, d_model: int):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts={self.num_experts}, got {self.top_k}")
        self.norm_topk_prob = config.norm_topk_prob
        self.jitter = config.router_jitter
        self.capacity_factor = config.capacity_factor
        self.router = MoERouter(d_model, self.num_experts, bias=False, dtype=torch.float32)  # float32 always
        self.dispatch = config.moe_dispatch
        self.experts = MoEExperts(self.num_experts, d_model, config.d_ffn, config.moe_dispatch)
        n_shared = config.num_shared_experts
        self.shared_experts = SwiGLUMLP(d_model, n_shared * config.d_ffn) if n_shared else None

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits in float32, also under autocast: x (T, D) -> (T, E)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x if x.dtype == torch.float64 else x.float()  # float64 stays float64 (reference checks)
            if self.training and self.jitter > 0:  # Switch's multiplicative input jitter
                x = x * torch.empty_like(x).uniform_(1 - self.jitter, 1 + self.jitter)
            w = self.router.weight
            # Through the module where it is float32 already, so that an FSDP unit of its own gathers it (in float32)
            return self.router(x) if w.dtype == x.dtype else F.linear(x, w.to(x.dtype))

    def route_and_cast(self, x: torch.Tensor, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`route(x)`, and x as the experts multiply it (in autocast's dtype): both in one pass where the kernels run
        (the eager `grouped_mm` dispatch on CUDA, a float32 x under autocast, no jitter drawn, the router not wrapped
        by an adapter), else `(route(x), x)` and the experts cast x themselves."""
        dtype = compute_dtype(x)
        if (grouped and isinstance(self.router, MoERouter) and not (self.training and self.jitter > 0)
                and router_kernel_takes(x, self.router.weight, dtype)):
            return self.router(x, cast=dtype)
        return self.route(x), x

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, parallel=None) -> tuple[torch.Tensor, dict]:
        """`parallel` (a `ContextParallel`): x is this process's chunk of sequences split across a group, whose
        router losses are those of the whole sequences."""
        if parallel is not None and parallel.size > 1 and (self.capacity_factor is not None or
                                                           (self.training and self.jitter > 0)):
            raise ValueError("a sequence split across processes cannot use capacity_factor or router_jitter: which "
                             "pairs an expert drops and the jitter's noise depend on the whole batch's token order")
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, D)
        T, E, k = flat.shape[0], self.num_experts, self.top_k
        valid = mask.reshape(-1).bool() if mask is not None else None
        capacity = None if self.capacity_factor is None else math.ceil(self.capacity_factor * T * k / E)
        grouped = resolve_dispatch(self.dispatch, flat) == "grouped_mm"  # static shapes: no host sync at all
        logits, xin = self.route_and_cast(flat, grouped)  # (T, E) fp32; the experts' input (T, D)
        if (grouped and parallel is None and compiles_here(COMPILE_EXPERTS, _EXPERTS_FAILED, flat)
                and grouped_mm_traceable(compute_dtype(flat), compiling=True)):
            out, counts, dropped, balance, z = self.experts(xin, routed=(logits, valid, capacity, E, k,
                                                                         self.norm_topk_prob))
        elif grouped and parallel is None:  # the routing and its losses in one piece (compiled: COMPILE_ROUTING)
            rows, counts, dropped, balance, z = route_eagerly_or_compiled(logits, valid, capacity, E, k,
                                                                          self.norm_topk_prob)
            out = self.experts(xin, rows=rows)
        else:
            probs, weights, experts = top_k_routes(logits, k, self.norm_topk_prob)  # (T, E), (T, k), (T, k)
            if grouped:  # (context parallelism: the losses below are the whole group's)
                *rows, counts, dropped = static_layout(experts, weights, valid, capacity, E)
                out = self.experts(xin, rows=tuple(rows))
            else:
                out, counts, dropped = self._sorted_dispatch(flat, experts, weights, valid, capacity)
            if parallel is None:
                balance, z = load_balancing_loss(probs, experts, E, valid), router_z_loss(logits, valid)
            else:
                balance, z = group_router_losses(probs, experts, logits, E, valid, parallel)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        aux = {"router_logits": logits, "balance_loss": balance, "z_loss": z, "expert_counts": counts,
               "dropped": dropped}
        return out.reshape(shape), aux

    def _sorted_dispatch(self, flat, experts, weights, valid, capacity):
        """The fused and loop dispatches: the pairs of real tokens, sorted by expert, padded slices; they need each
        expert's count on the host (one sync), which CPUs do not mind."""
        T, E, k = flat.shape[0], self.num_experts, self.top_k
        # Pairs in slot-major order (every first choice, then every second choice, ...), stably sorted by expert:
        # within an expert's slice first choices come first, each in token order (the capacity priority).
        pair_expert = experts.t().reshape(-1)  # (k T,)
        pair_token = torch.arange(T, device=flat.device).repeat(k)
        pair_weight = weights.t().reshape(-1)
        if valid is not None:  # padding is routed nowhere
            keep = valid.repeat(k)
            pair_expert, pair_token, pair_weight = pair_expert[keep], pair_token[keep], pair_weight[keep]
        order = torch.sort(pair_expert, stable=True).indices
        sorted_expert = pair_expert[order]
        counts = torch.bincount(pair_expert, minlength=E)  # (E,)
        dropped = counts.new_zeros(())
        if capacity is not None:
            starts = counts.cumsum(0) - counts
            rank = torch.arange(order.numel(), device=flat.device) - starts[sorted_expert]  # position in its slice
            fits = rank < capacity
            dropped = (~fits).sum()
            order, sorted_expert = order[fits], sorted_expert[fits]
        kept_counts = torch.bincount(sorted_expert, minlength=E)
        token, weight, kept_counts = pad_slices(pair_token[order], pair_weight[order], sorted_expert, kept_counts)
        return self.experts(flat, token, weight, kept_counts), counts, dropped  # (T, D), autocast dtype if any


ROUTER_LOSSES = ("aux_loss", "balance_loss", "z_loss")
"""The router's losses in a model output: the weighted sum that joins `loss`, then the unweighted layer means of the
load-balancing and z losses (for logging)."""
ROUTER_COUNTS = ("expert_counts", "dropped_counts")
"""Routing statistics in a model output: routed pairs per layer and expert `(n_moe, E)`, pairs dropped by the
capacity limit per layer `(n_moe,)`."""
MOE_OUTPUTS = (*ROUTER_LOSSES, "router_logits", *ROUTER_COUNTS)
"""Every mixture-of-experts field of a model output (each output class declares them all)."""


def router_outputs(output) -> dict:
    """What a trainer reads of a model output (a `ModelOutput` or a dict): the router losses and routing statistics
    present in it, by name; empty for a model without MoE layers. The one place those names are read."""
    get = output.get if hasattr(output, "get") else lambda key: getattr(output, key, None)
    return {key: get(key) for key in (*ROUTER_LOSSES, *ROUTER_COUNTS) if get(key) is not None}


def moe_losses(auxes: list[dict], config) -> dict:
    """Combine the layers' `aux` dicts: the weighted auxiliary loss (layer means of the balance and z losses times
    `router_aux_loss_coef` and `router_z_loss_coef`), those two means (detached, for logging), the router logits per
    layer, and the load statistics stacked per layer (`expert_counts (n_moe, E)`, `dropped_counts (n_moe,)`)."""
    if not auxes:
        return {}
    balance = torch.stack([a["balance_loss"] for a in auxes]).mean()
    z = torch.stack([a["z_loss"] for a in auxes]).mean()
    return {"aux_loss": config.router_aux_loss_coef * balance + config.router_z_loss_coef * z,
            "balance_loss": balance.detach(), "z_loss": z.detach(),
            "router_logits": tuple(a["router_logits"] for a in auxes),
            "expert_counts": torch.stack([a["expert_counts"] for a in auxes]).detach(),
            "dropped_counts": torch.stack([a["dropped"] for a in auxes]).detach()}


def init_moe_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) init of the 3-D expert weights (the base class's `_init_weights` covers only Linears)."""
    if isinstance(module, MoEExperts):
        with torch.no_grad():
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
