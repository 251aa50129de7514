"""Batches: collation of packed text blocks and labelled sequences, and the train/validation loaders every task's
data goes through (seeded shuffling, full batches, a capped validation split)."""

from __future__ import annotations

import torch

from ..config import DataCfg
from ..errors import DataError

def collate_lm(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack blocks; the targets are the inputs (the model shifts them: position t predicts t + 1)."""
    input_ids = torch.stack([e["input_ids"] for e in examples])
    return {"input_ids": input_ids, "labels": input_ids.clone()}

def collate_fn(cfg: DataCfg):
    """Examples -> a batch: packed text blocks (`collate_lm`) or labelled sequences (`collate_arrays`)."""
    if cfg.is_text:
        return collate_lm
    from .arrays import collate_arrays

    return collate_arrays

def build_dataloaders(cfg: DataCfg, data, seed: int, eval_max_batches: int | None = None,
                      num_processes: int = 1, collate=None):
    """Train loader (shuffled with a seeded generator, full batches only) and validation loader (in order; the first
    `eval_max_batches` batches per process when capped) over `data.train`/`data.val` (`datasets.Dataset`s or torch
    map-style datasets), batched by `collate` (default: the data source's own)."""
    from torch.utils.data import DataLoader, Subset

    if len(data.train) < cfg.batch_size * num_processes:
        raise DataError(f"the train split has {len(data.train)} examples, fewer than one batch "
                        f"(data.batch_size={cfg.batch_size} x {num_processes} process(es))")
    if data.val is None or len(data.val) == 0:
        raise DataError("the validation split is empty")
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    val = data.val
    if eval_max_batches is not None:  # cut the dataset, not the loop: a prepared loader must run to its end
        keep = range(min(len(val), eval_max_batches * eval_bs * num_processes))
        val = val.select(keep) if hasattr(val, "select") else Subset(val, keep)
    generator = torch.Generator().manual_seed(seed)
    collate = collate or collate_fn(cfg)
    train_dl = DataLoader(data.train, batch_size=cfg.batch_size, shuffle=True, drop_last=True,
                          collate_fn=collate, num_workers=cfg.num_workers, generator=generator)
    val_dl = DataLoader(val, batch_size=eval_bs, shuffle=False, collate_fn=collate, num_workers=cfg.num_workers)
    return train_dl, val_dl
