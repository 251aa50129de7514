"""Data: every source behind one build function, and the data's say in the model's shape.

    text.py     documents (the built-in plays, your files) -> tokenizer -> packed blocks (TextData)
    arrays.py   labelled sequences (digits, UCR sets, your .npz/.csv) (ArrayData)
    streams.py  contiguous per-process streams for stateful training
    loaders.py  collation and the train/validation loaders
"""

from __future__ import annotations

from pathlib import Path

from ..config import DataCfg
from .arrays import ArrayData, build_array_data, collate_arrays
from .loaders import build_dataloaders, collate_fn, collate_lm
from .streams import stream_loader
from .text import (TextData, build_text_data, clean_play, shakespeare_files, token_byte_and_char_counts,
                   tokenizer_spec)

def build_data(cfg: DataCfg, tokenizer_dir: Path | None = None):
    """`TextData` for a text source, `ArrayData` (arrays.py) for an array source."""
    if cfg.is_text:
        return build_text_data(cfg, tokenizer_dir)
    return build_array_data(cfg)

def data_spec(cfg: DataCfg, data=None) -> dict:
    """The model config fields the data decides: the tokenizer's for text; features, labels and task for arrays.
    Without `data`, what can be known cheaply (the BPE's size without training it; array files are read)."""
    if cfg.is_text:
        if data is None:
            return tokenizer_spec(cfg)
        tok = data.tokenizer
        return {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    if data is None:
        data = build_array_data(cfg)
    spec = {"d_input": data.d_input, "num_labels": data.num_labels,
            "problem_type": "regression" if data.num_labels == 1 else "single_label_classification"}
    if data.class_names:
        spec["id2label"] = dict(enumerate(data.class_names))
    return spec


__all__ = ["ArrayData", "TextData", "build_array_data", "build_data", "build_dataloaders", "build_text_data",
           "clean_play", "collate_arrays", "collate_fn", "collate_lm", "data_spec", "shakespeare_files",
           "stream_loader", "token_byte_and_char_counts", "tokenizer_spec"]
