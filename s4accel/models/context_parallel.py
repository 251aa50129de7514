"""Context parallelism for S4 models: each sequence of length L split into P contiguous chunks of L/P steps, one per
process of a group, every output equal to the single-process one.

Why it is exact and cheap: an S4 layer is linear and time-invariant, so what the steps before a chunk add to its
outputs is the state they leave, `N/2` complex numbers per channel however long the chunk (`state_output`), and that
state is each earlier chunk's own end state (`forward_state` from zero) carried through the chunks between them by
`dA^(L/P)`. So a layer convolves its chunk locally, gathers every chunk's end state in one collective of size
independent of L (`ContextParallel.gather`), and adds what the earlier chunks' states reach (and, bidirectional, the
later chunks' through the anti-causal kernel). The backward passes through the same exchange: the gather's adjoint is
a sum over the group. Pooling a classifier over the whole sequence and the router statistics of an MoE block are
sums over the group (`all_reduce`).

Hand-written because the context parallelism of torch, Accelerate and transformers is ring attention through SDPA:
nothing there splits a convolution or a recurrence.

Dropout draws its masks per block of `DROPOUT_BLOCK` positions from a seed drawn once per call, so a position's mask
is the same whichever process holds it: the random stream does not depend on P (when one process runs with a
`ContextParallel` of size 1, it draws the same masks).

Copied into Hub repositories with the modeling files that import it: it imports only torch.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist

DROPOUT_BLOCK = 256
"""Positions per dropout block: each block's mask comes from its own generator, seeded by the call's seed and the
block's index along the whole sequence."""


class ContextParallel:
    """The processes that share each sequence, and this process's chunk of it. `group`: a process group
    (`torch.distributed.group.WORLD` for all processes; None: this process alone, the whole sequence, yet with the
    same dropout masks as any split of it)."""

    def __init__(self, group=None):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def __deepcopy__(self, memo):
        return self  # a handle on processes, as a device is: a copy of the model (EMA) shares it

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, size={self.size})"

    def chunk(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This process's contiguous chunk of a whole-sequence tensor along `dim`."""
        L = t.shape[dim]
        if L % self.size:
            raise ValueError(f"a sequence of {L} steps does not split into {self.size} equal chunks")
        n = L // self.size
        return t.narrow(dim, self.rank * n, n).contiguous()

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every process's `t` stacked in rank order, (P, ...); its gradient reaches each process's own `t`."""
        if self.size == 1:
            return t[None]
        return _Gather.apply(t.contiguous(), self.group, self.size, self.rank)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the group, the same on every process; differentiable (the adjoint is a sum too)."""
        if self.size == 1:
            return t
        return _AllReduce.apply(t.contiguous(), self.group)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """The largest value of `t` over the group (no gradient)."""
        if self.size == 1:
            return t
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def dropout(self, x: torch.Tensor, p: float, time_dim: int = 1) -> torch.Tensor:
        """Inverted dropout of `x`, whose `time_dim` is this process's chunk of the sequence, with masks that depend
        on each position's place in the whole sequence only. Masks are drawn in `(B, block, H)` layout and moved
        to `x`'s (time at `time_dim`, the batch and channel dimensions in their order otherwise)."""
        if p == 0:
            return x
        seed = int(torch.randint(0, 2**62, ()))  # from the default generator: the same draw on every process
        L = x.shape[time_dim]
        start = self.rank * L
        first, last = start // DROPOUT_BLOCK, (start + L - 1) // DROPOUT_BLOCK
        moved = x.movedim(time_dim, 1)  # (B, L, ...) view
        g = torch.Generator(device=x.device)
        blocks = []
        for b in range(first, last + 1):
            g.manual_seed((seed + b * 0x9E3779B97F4A7C15) % 2**63)
            blocks.append(torch.rand((moved.shape[0], DROPOUT_BLOCK, *moved.shape[2:]), generator=g,
                                     device=x.device))
        keep = torch.cat(blocks, 1).narrow(1, start - first * DROPOUT_BLOCK, L) >= p
        return (moved * keep.to(x.dtype) / (1 - p)).movedim(1, time_dim)


class ChunkRows(NamedTuple):
    """What a layer needs to know of its chunk's rows beyond the `Documents` in them: the group, and per row whether
    the chunk's first position starts a document (`fresh (B,)`, None: no `position_ids`), so that nothing before it
    reaches it."""

    parallel: ContextParallel
    fresh: torch.Tensor | None


# The collectives with their adjoints. Written here because torch's autograd-aware ones
# (`torch.distributed.nn.functional.all_gather`, `all_reduce`) are deprecated in torch 2.13 and warn on every call,
# and their named replacements live in a private module.


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group, size, rank):
        ctx.group, ctx.rank = group, rank
        out = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(out, t, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every process's use of each chunk's value, summed
        return grad[ctx.rank], None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
