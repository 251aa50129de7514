"""Mixture-of-experts feed-forward layer, shared by `MoEForCausalLM` and the S4 blocks (`S4Config.ffn="moe"`).

Notation: `T` tokens of width `D` (`d_model`), `E` experts (`num_experts`) of hidden width `F` (`d_ffn`), each token
routed to `k` experts (`num_experts_per_tok`). Per token `x`:

    logits = W_r x                      (E,), in float32 whatever the autocast dtype
    p = softmax(logits);  (w, e) = top-k of p, renormalised to sum 1 when `norm_topk_prob`
    y = sum_j w_j SwiGLU_{e_j}(x)  [+ SwiGLU_shared(x)]
    SwiGLU_e(x) = down_proj[e] (silu(gate) * up),  (gate, up) = gate_up_proj[e] x

Dispatch sorts the `T k` (token, expert) pairs by expert so that each expert runs one matmul on a contiguous slice:
`torch.nn.functional.grouped_mm` over all slices at once (the default on CUDA in bf16, where it is one fused kernel;
it also runs on CPU in float32/bf16/fp16), or a loop over the slices (the default elsewhere: on CPU it is faster).
The experts' weights are 3-D parameters (`gate_up_proj (E, 2F, D)`, `down_proj (E, D, F)`,
the layout of transformers' MoE models), so every expert's weights take part in each step's graph even when it
receives no token: DDP never waits for an unused parameter.

With `capacity_factor` set, an expert takes at most `ceil(capacity_factor T k / E)` pairs; first choices are served
before second choices, each in token order. A dropped pair contributes nothing; a token whose pairs are all dropped
gets a zero output, so the residual connection around the layer passes it through unchanged.

This file is copied into Hub repositories for `trust_remote_code` loading: it imports only torch.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

DISPATCHES = ("auto", "grouped_mm", "loop")


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss `E sum_e f_e P_e` over the (unmasked) tokens.

    probs (T, E): router softmax; experts (T, k): chosen experts; mask (T,) bool: real tokens (None: all).
    `f_e` = (pairs routed to e) / T, `P_e` = mean router probability of e. As in transformers' Mixtral it equals
    `k` under perfectly uniform routing (`f_e = k/E`, `P_e = 1/E`) and grows to `E` when one expert takes every
    token with probability 1 (top-1).
    """
    if mask is not None:
        probs, experts = probs[mask], experts[mask]
    if probs.shape[0] == 0:
        return probs.new_zeros(())
    f = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype) / probs.shape[0]  # (E,), no grad
    return num_experts * (f * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss `mean(logsumexp(logits)^2)` over the (unmasked) tokens: keeps router logits small."""
    z = torch.logsumexp(logits, dim=-1) ** 2  # (T,)
    if mask is not None:
        z = z[mask]
    return z.mean() if z.numel() else logits.new_zeros(())


def _grouped_mm_pays(x: torch.Tensor) -> bool:
    """Where `grouped_mm` is one fused kernel: CUDA, bf16, compute capability >= 8. On CPU it runs a matmul per group
    anyway, and measured slower than the slice loop (bench/moe.py: 104 vs 90 ms at E=8, 259 vs 206 ms at E=64)."""
    return (hasattr(F, "grouped_mm") and x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU feed-forward: (..., D) -> (..., D) through hidden width F."""

    def __init__(self, d_model: int, d_ffn: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(d_model, 2 * d_ffn, bias=False)
        self.down_proj = nn.Linear(d_ffn, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoEExperts(nn.Module):
    """E SwiGLU experts stored as 3-D weights. forward(x (P, D) sorted by expert, counts (E,)) -> (P, D)."""

    def __init__(self, num_experts: int, d_model: int, d_ffn: int, dispatch: str = "auto"):
        super().__init__()
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        self.dispatch = dispatch
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * d_ffn, d_model))  # (E, 2F, D)
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, d_ffn))  # (E, D, F)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # grouped_mm and the 3-D weights are not autocast by torch
            x = x.to(torch.get_autocast_dtype(x.device.type))
        gate_up, down = self.gate_up_proj.to(x.dtype), self.down_proj.to(x.dtype)
        if x.shape[0] == 0:  # no token at all (all padding): the weights still join the graph, with zero gradient
            return x + 0 * (gate_up.sum() + down.sum())
        dispatch = self.dispatch
        if dispatch == "auto":
            dispatch = "grouped_mm" if _grouped_mm_pays(x) else "loop"
        if dispatch == "grouped_mm":
            offs = counts.cumsum(0).to(torch.int32)  # end of each expert's slice
            h = F.grouped_mm(x, gate_up.transpose(1, 2), offs=offs)  # (P, 2F)
            gate, up = h.chunk(2, dim=-1)
            return F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)  # (P, D)
        out = []
        # unbind, not gate_up[e]: the backward of E separate index ops would build E full-size (E, 2F, D) gradients
        for xe, w1, w2 in zip(x.split(counts.tolist()), gate_up.unbind(0), down.unbind(0)):  # one host sync
            gate, up = F.linear(xe, w1).chunk(2, dim=-1)
            out.append(F.linear(F.silu(gate) * up, w2))
        return torch.cat(out)


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
        self.router = nn.Linear(d_model, self.num_experts, bias=False)
        self.experts = MoEExperts(self.num_experts, d_model, config.d_ffn, config.moe_dispatch)
        n_shared = config.num_shared_experts
        self.shared_experts = SwiGLUMLP(d_model, n_shared * config.d_ffn) if n_shared else None

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits in float32, also under autocast: x (T, D) -> (T, E)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            x = x.float()
            if self.training and self.jitter > 0:  # Switch's multiplicative input jitter
                x = x * torch.empty_like(x).uniform_(1 - self.jitter, 1 + self.jitter)
            return F.linear(x, self.router.weight.float())

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, D)
        T, E, k = flat.shape[0], self.num_experts, self.top_k
        valid = mask.reshape(-1).bool() if mask is not None else None
        logits = self.route(flat)  # (T, E) fp32
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)

        # Pairs in slot-major order (every first choice, then every second choice, ...), stably sorted by expert:
        # within an expert's slice first choices come first, each in token order (the capacity priority).
        pair_expert = experts.t().reshape(-1)  # (k T,)
        pair_token = torch.arange(T, device=x.device).repeat(k)
        pair_weight = weights.t().reshape(-1)
        if valid is not None:  # padding is routed nowhere
            keep = valid.repeat(k)
            pair_expert, pair_token, pair_weight = pair_expert[keep], pair_token[keep], pair_weight[keep]
        order = torch.sort(pair_expert, stable=True).indices
        sorted_expert = pair_expert[order]
        counts = torch.bincount(pair_expert, minlength=E)  # (E,)
        dropped = counts.new_zeros(())
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * T * k / E)
            starts = counts.cumsum(0) - counts
            rank = torch.arange(order.numel(), device=x.device) - starts[sorted_expert]  # position in its slice
            fits = rank < capacity
            dropped = (~fits).sum()
            order, sorted_expert = order[fits], sorted_expert[fits]
        kept_counts = torch.bincount(sorted_expert, minlength=E)
        token = pair_token[order]
        y = self.experts(flat.index_select(0, token), kept_counts)  # (P, D), in the autocast dtype if any
        y = y * pair_weight[order, None].to(y.dtype)
        out = y.new_zeros(T, shape[-1]).index_add_(0, token, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        aux = {"router_logits": logits, "balance_loss": load_balancing_loss(probs, experts, E, valid),
               "z_loss": router_z_loss(logits, valid), "expert_counts": counts, "dropped": dropped}
        return out.reshape(shape), aux


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
