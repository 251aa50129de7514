"""Documents packed into one row, read one by one without a loop over them: `Documents.apply` gathers each
document into a zero-padded row of a length bucket, runs a computation on every bucket at once and puts the results
back in place. Used by the S4 convolution and the MoE transformer's attention for `position_ids` that restart inside
a row (transformers' convention for packed sequences).

Hand-written because transformers' support for packed sequences is for attention (variable-length flash kernels on
CUDA, block-diagonal masks elsewhere): a convolution needs the documents apart, and the same buckets make attention
within documents cost the sum of their squared lengths rather than the block's.

Copied into Hub repositories with the modeling files that import it: it imports only torch.
"""

import torch
from torch.autograd.function import once_differentiable


class Documents:
    """Where the documents packed into a batch lie, for a layer to read each one on its own.

    From `position_ids (B, L)`, transformers' convention for packed sequences: a position whose id is 0 starts a
    document, which runs to the next start or the row's end. Column 0 continues the state the row was given (a cache
    or a carried state) unless its id is 0. `apply` computes each document in a row of its own, zero-padded to a
    bucket length (one batched computation per bucket, not a loop over documents): an S4 layer's convolution, an
    attention layer's causal attention. No output reads another document's inputs, bit for bit.
    """

    MIN_BUCKET = 16

    @staticmethod
    def of(position_ids: torch.Tensor | None) -> "Documents | None":
        """The documents of `position_ids`, or None when a row holds one (or none given): then nothing is split."""
        if position_ids is None or position_ids.shape[1] < 2 or not bool((position_ids[:, 1:] == 0).any()):
            return None
        return Documents(position_ids)

    def __init__(self, position_ids: torch.Tensor):
        B, L = position_ids.shape
        device = position_ids.device
        starts = position_ids == 0  # (B, L)
        self.continues = ~starts[:, 0]  # (B,) the row's first document began before this block
        starts = starts.clone()
        starts[:, 0] = True  # every row's first position starts a segment
        seg = starts.long().cumsum(-1)  # (B, L) 1-based segment number within the row
        self.first = (seg == 1) & self.continues[:, None]  # (B, L): positions a given initial state reaches
        self.last = seg == seg[:, -1:]  # (B, L): the row's last segment, whose end state is the row's
        self.single = seg[:, -1] == 1  # (B,) one segment: an initial state reaches the row's end too
        flat_starts = starts.flatten().nonzero().squeeze(-1)  # (S,) into the B*L positions, in order
        row_end = (flat_starts // L + 1) * L
        ends = torch.cat([flat_starts[1:], flat_starts.new_tensor([B * L])])
        ends = torch.minimum(ends, row_end)
        lengths = ends - flat_starts  # (S,)
        # a half-octave grid (16, 24, 32, 48, 64, 96, ... in multiples of 8; less padding than powers of two, few
        # buckets), never past the block: a document's bucket depends on its own length alone, so which other
        # documents share its computation never changes its outputs
        half_octaves = torch.ceil(2 * torch.log2(lengths.double().clamp(min=self.MIN_BUCKET)))
        buckets = (torch.ceil(2 ** (half_octaves / 2) / 8) * 8).long().clamp(max=L)
        self.groups = []  # (bucket length, gather index (n, Lb) into B*L + 1, the last being a zero row)
        where = torch.empty(B * L, dtype=torch.long, device=device)  # each position's row in the outputs
        offset = 0
        for Lb in sorted(set(buckets.tolist())):
            pick = (buckets == Lb).nonzero().squeeze(-1)
            s, n = flat_starts[pick], lengths[pick]
            steps = torch.arange(Lb, device=device)
            index = s[:, None] + steps  # (n, Lb)
            valid = steps < n[:, None]
            self.groups.append((Lb, torch.where(valid, index, B * L)))
            where[index[valid]] = offset + (torch.arange(len(pick), device=device)[:, None] * Lb + steps)[valid]
            offset += len(pick) * Lb
        self.where = where
        self.index = torch.cat([index.flatten() for _, index in self.groups])  # (T,) the bucket rows' positions

    def apply(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        """`fn(*vs) -> (n, Lb, ...)`, each `v (n, Lb, ...)` the documents of one bucket, zero-padded, applied to the
        documents of each `x (B, L, ...)` alone -> (B, L, ...)."""
        B, L = xs[0].shape[:2]
        rows = [_ToDocuments.apply(x.reshape(B * L, -1), self.index, self.where) for x in xs]  # (T, ...)
        outs, offset = [], 0
        for Lb, index in self.groups:
            n = index.shape[0]
            vs = [r[offset: offset + n * Lb].view(n, Lb, *x.shape[2:]) for r, x in zip(rows, xs)]
            out = fn(*vs)
            outs.append(out.reshape(n * Lb, -1))
            offset += n * Lb
        y = _FromDocuments.apply(torch.cat(outs), self.where, self.index)
        return y.view(B, L, *out.shape[2:])


class _ToDocuments(torch.autograd.Function):
    """Positions (B*L, H) -> the documents' bucket rows (T, H), zeros where a row pads its document. Every position
    sits in exactly one place, so the backward is the inverse gather, not autograd's scatter-add of an indexing
    (which cost a quarter of a training step on short documents)."""

    @staticmethod
    def forward(ctx, x, index, where):
        ctx.save_for_backward(where)
        return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (where,) = ctx.saved_tensors
        return grad.index_select(0, where), None, None


class _FromDocuments(torch.autograd.Function):
    """The bucket rows (T, H) -> positions (B*L, H); the inverse of `_ToDocuments` (the padding's rows get no
    gradient)."""

    @staticmethod
    def forward(ctx, y, where, index):
        ctx.save_for_backward(index)
        return y.index_select(0, where)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return torch.cat([grad, grad.new_zeros(1, grad.shape[1])]).index_select(0, index), None, None
