"""Label smoothing (`train.label_smoothing`, transformers.Trainer's `label_smoothing_factor`): the built-in tasks'
training loss against targets mixed with the uniform distribution, `(1 - e) one-hot + e / classes`, as
`torch.nn.functional.cross_entropy(label_smoothing=e)` computes it. Evaluation keeps the plain negative
log-likelihood, so runs with and without it compare.

transformers' causal-LM loss takes no smoothing (its `fixed_cross_entropy` hands `cross_entropy` none), so the
language model gets one of its own here, set through `PreTrainedModel.loss_function`'s setter: every path that
computes the model's loss (stateful training, a sequence split across processes with its `shift_labels`, the compiled
loss, which compiles whatever function is set) smooths alike. The classifier's loss is the task's (tasks_builtin.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F


def smoothed_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
                            num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                            shift_labels: torch.Tensor | None = None, *, smoothing: float, **kwargs) -> torch.Tensor:
    """transformers' causal-LM loss contract (position t predicts `labels[t + 1]`, or `shift_labels[t]` when given;
    the mean over real targets, or their sum over `num_items_in_batch`) with smoothed targets. Ignored targets
    (`ignore_index`) count in neither the loss nor its smoothing term. logits (B, L, V), labels (B, L)."""
    logits = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                           ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else
                       num_items_in_batch)
    return loss


def smooth_lm_loss(model: torch.nn.Module, smoothing: float) -> None:
    """Set the smoothed loss on a causal LM (its base model under PEFT); nothing when `smoothing` is 0."""
    if smoothing:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.loss_function = partial(smoothed_causal_lm_loss, smoothing=smoothing)


def smoothed_classification_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    """The mean cross-entropy of a batch of class logits (B, C) against smoothed targets (B,)."""
    return F.cross_entropy(logits.float(), labels, label_smoothing=smoothing)
