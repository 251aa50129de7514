"""Batches: collation of packed text blocks and labelled sequences, and the train/validation loaders every task's
data goes through (seeded shuffling, full batches, a capped validation split)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from ..config import DataCfg
from ..errors import DataError
from .arrays import collate_arrays


def collate_lm(examples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack blocks (stored as small unsigned integers) into int64 ids; the targets are the inputs (the model shifts
    them: position t predicts t + 1)."""
    input_ids = torch.stack([torch.as_tensor(e["input_ids"]) for e in examples]).long()
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def document_positions(input_ids: torch.Tensor, eos: int, continued: torch.Tensor | None = None) -> torch.Tensor:
    """`position_ids (B, L)` of packed documents: each position's index within its document, a document starting
    after every `eos` and at the block's first position. `continued (B,)`: rows whose first document began in an
    earlier block (a stateful stream's next chunk): their first document counts from 1, not 0, so the model carries
    its state into it."""
    B, L = input_ids.shape
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos
    starts[:, 0] = True
    column = torch.arange(L).expand(B, L)
    start_of = torch.where(starts, column, 0).cummax(-1).values  # (B, L): the column its document starts at
    positions = column - start_of
    if continued is not None:
        positions = positions + (continued[:, None] & (start_of == 0))
    return positions


def collate_isolated(eos: int):
    """`collate_lm` for `data.packing: isolated`: `position_ids` mark where each document starts, and the target
    after each `eos` (the next document's first token, predicted from the one before) is masked. (transformers'
    `DataCollatorWithFlattening` gives the same `position_ids` for separate examples it joins into one row; our
    blocks are cut from a stream of documents, whose boundaries are the end-of-document tokens.)"""
    def collate(examples: list[dict], continued: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        batch = collate_lm(examples)
        ids = batch["input_ids"]
        batch["position_ids"] = document_positions(ids, eos, continued)
        batch["labels"][:, 1:][ids[:, :-1] == eos] = -100
        return batch
    return collate


def lm_collate(cfg: DataCfg, eos: int):
    """A language model's batches as `data.packing` says: `isolated` marks where each document starts
    (`collate_isolated`), `concat` reads a block as one text (`collate_lm`)."""
    return collate_isolated(eos) if cfg.packing == "isolated" else collate_lm


def collate_fn(cfg: DataCfg):
    """Examples -> a batch: packed text blocks (`collate_lm`) or labelled sequences of numbers (`collate_arrays`).
    Labelled documents are padded per batch: their collation comes with their data (`collate_labelled_text`)."""
    if cfg.is_text:
        return collate_lm
    return collate_arrays


def build_dataloaders(cfg: DataCfg, data, seed: int, eval_max_batches: int | None = None,
                      num_processes: int = 1, collate=None):
    """Train loader and validation loader over `data.train`/`data.val` (`datasets.Dataset`s or torch datasets),
    batched by `collate` (default: the data source's own). A map-style train split is shuffled with a seeded generator
    in full batches only; a stream (an iterable dataset handing each process its own blocks) is read as it comes. The
    validation split is read in order, its first `eval_max_batches` batches per process when capped."""
    collate = collate or collate_fn(cfg)
    if isinstance(data.train, IterableDataset):
        # A generator of its own: otherwise each new iterator draws a seed from the global RNG, and a resumed run,
        # which creates one more, would draw other dropout masks.
        train_dl = DataLoader(data.train, batch_size=cfg.batch_size, collate_fn=collate,
                              generator=torch.Generator().manual_seed(seed))
    else:
        if len(data.train) < cfg.batch_size * num_processes:
            raise DataError(f"the train split has {len(data.train)} examples, fewer than one batch "
                            f"(data.batch_size={cfg.batch_size} x {num_processes} process(es))")
        train_dl = DataLoader(data.train, batch_size=cfg.batch_size, shuffle=True, drop_last=True,
                              collate_fn=collate, num_workers=cfg.num_workers,
                              generator=torch.Generator().manual_seed(seed))
    return train_dl, eval_loader(cfg, data.val, eval_max_batches, num_processes, collate)


def eval_loader(cfg: DataCfg, val, eval_max_batches: int | None = None, num_processes: int = 1, collate=None,
                what: str = "the validation split"):
    """An evaluation set's loader: read in order, batches of `data.eval_batch_size`, its first `eval_max_batches`
    batches per process when capped."""
    if val is None or len(val) == 0:
        raise DataError(f"{what} is empty")
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    if eval_max_batches is not None:  # cut the dataset, not the loop: a prepared loader must run to its end
        keep = range(min(len(val), eval_max_batches * eval_bs * num_processes))
        val = val.select(keep) if hasattr(val, "select") else Subset(val, keep)
    return DataLoader(val, batch_size=eval_bs, shuffle=False, collate_fn=collate or collate_fn(cfg),
                      num_workers=cfg.num_workers)
