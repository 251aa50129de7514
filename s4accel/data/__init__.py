"""Data: every source behind one build function, and the data's say in the model's shape.

    sources.py        documents from the built-in plays, your files (.txt/.json/.jsonl/.csv/.parquet/.arrow), or any
                      `datasets` source (Hub id, local folder, save_to_disk folder)
    tokenize.py       byte / BPE / any AutoTokenizer; fast tokenising and packing on Arrow buffers
    text.py           documents -> packed blocks for a language model (one source or a mixture)
    streaming.py      the same, read on the fly (data.streaming): one block sequence dealt out to the processes,
                      resumable on any number of them, shuffled, flat memory
    source_stream.py  one streamed source's documents -> blocks, shard by shard, its position saved at any block
    shuffle_buffer.py a seeded shuffle buffer of blocks whose contents are part of its position
    labelled.py       labelled documents for a sequence classifier (data.label_field)
    arrays.py         labelled sequences of numbers (digits, UCR sets, your .npz/.csv, LRA's images)
    lra_text.py       Long Range Arena's ListOps and Retrieval files as labelled documents; the ListOps tokenizer
    lra_images.py     Long Range Arena's Pathfinder/Path-X folders and CIFAR-10 as grayscale pixel sequences
    stateful_rows.py  contiguous per-process rows for stateful training
    loaders.py        collation and the train/validation loaders
"""

from __future__ import annotations

import errno
from pathlib import Path

from ..config import DataCfg
from .arrays import ArrayData, build_array_data, collate_arrays
from .labelled import LabelledTextData, build_labelled_text, collate_labelled_text
from .loaders import build_dataloaders, collate_fn, eval_loader, collate_isolated, collate_lm, lm_collate
from .sources import clean_play, disk_full_error, shakespeare_files
from .stateful_rows import stream_loader
from .streaming import build_stream_data
from .text import TextData, build_text_data
from .tokenize import build_tokenizer, token_byte_and_char_counts, tokenizer_fields, tokenizer_spec, vocab_extent


def build_data(cfg: DataCfg, tokenizer_dir: Path | None = None, seed: int = 0, rank: int = 0, world_size: int = 1):
    """`TextData` for documents (a language model; streamed with `data.streaming`), `LabelledTextData` for labelled
    documents, `ArrayData` for sequences of numbers. `seed`: a mixture's; `rank`, `world_size`: a stream's share.
    A full disk under the datasets cache (tokenised data is written there) is one line naming it."""
    try:
        return _build(cfg, tokenizer_dir, seed, rank, world_size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(cfg.cache_dir) from None
        raise


def _build(cfg: DataCfg, tokenizer_dir: Path | None, seed: int, rank: int, world_size: int):
    if cfg.is_lm and cfg.streaming:
        return build_stream_data(cfg, tokenizer_dir, seed, rank, world_size)
    if cfg.is_lm:
        return build_text_data(cfg, tokenizer_dir, seed)
    if cfg.is_text:
        return build_labelled_text(cfg, tokenizer_dir)
    return build_array_data(cfg)


def data_spec(cfg: DataCfg, data=None) -> dict:
    """The model config fields the data decides: the tokenizer's (documents), features, labels and task (labelled
    data). Without `data`, what can be known cheaply (the BPE's size without training it; labels are read)."""
    spec = {}
    if cfg.is_text:
        if data is None and cfg.is_lm:
            return tokenizer_spec(cfg)
        if data is None:
            data = build_labelled_text(cfg)
        spec = tokenizer_fields(data.tokenizer)
        if cfg.is_lm:
            return spec
    elif data is None:
        data = build_array_data(cfg)
    if not cfg.is_text:
        spec["d_input"] = data.d_input
        if data.input_mean is not None:  # the model standardises raw inputs itself (see arrays.py)
            spec.update(input_mean=data.input_mean, input_scale=data.input_std)
    spec.update(num_labels=data.num_labels,
                problem_type="regression" if data.num_labels == 1 else "single_label_classification")
    if data.class_names:
        spec["id2label"] = dict(enumerate(data.class_names))
    return spec


LABELS_OF = {"lra_listops": 10, "lra_retrieval": 2, "lra_pathfinder": 2, "lra_image": 10}
"""Long Range Arena's label counts: ListOps' answer digit, Retrieval's match or not, Pathfinder's connected or not,
CIFAR-10's classes (the image task's dataset)."""


def recipe_spec(cfg: DataCfg) -> tuple[dict, str | None]:
    """`data_spec` from the recipe alone, for showing a model whose data is not on this machine: the tokenizer's
    fields (byte, BPE, ListOps, a tokenizer folder that is here), LRA's label counts and pixel features. Returns the
    fields and what had to be assumed (None when nothing was)."""
    if cfg.is_lm:
        return tokenizer_spec(cfg), None
    spec = tokenizer_spec(cfg) if cfg.is_text else {"d_input": 1}  # LRA's images are one gray value per step
    assumed = []
    if not cfg.is_text and cfg.source not in LABELS_OF:
        assumed.append("1 feature per step")
    labels = LABELS_OF.get(cfg.source)
    if labels is None:
        labels = 2
        assumed.append("2 labels")
    spec.update(num_labels=labels, problem_type="single_label_classification")
    return spec, " and ".join(assumed) or None


__all__ = ["ArrayData", "LabelledTextData", "TextData", "build_array_data", "build_data", "build_dataloaders",
           "build_labelled_text", "build_text_data", "build_tokenizer", "clean_play", "collate_arrays", "collate_fn",
           "collate_isolated", "collate_labelled_text", "collate_lm", "data_spec", "eval_loader", "lm_collate",
           "recipe_spec", "shakespeare_files", "stream_loader", "token_byte_and_char_counts", "tokenizer_fields",
           "tokenizer_spec", "vocab_extent"]
