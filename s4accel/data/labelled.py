"""Labelled documents for a sequence classifier (`data.label_field`): each document's first `seq_len` tokens and its
label, batched with right padding and an attention mask (as the state-spaces/s4 trainer does for byte-level IMDB).

Labels: a `ClassLabel` column keeps its names; other values (strings or numbers) become classes in sorted order,
named by their text. The validation set is one of its own (`val_files`, `val_split`) or a seeded `val_fraction`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from ..config import DataCfg
from ..errors import DataError
from .progress import counted, tokenizing
from .sources import load_source
from .text import eval_set_documents
from .tokenize import build_tokenizer, encode, token_dtype


@dataclass
class LabelledTextData:
    train: object  # datasets.Dataset of {"input_ids": (n_i,), "labels": int}
    val: object
    tokenizer: object
    num_labels: int
    class_names: list[str]
    seq_len: int
    pad_token_id: int
    eval_sets: dict = field(default_factory=dict)
    """`data.eval_sets`, tokenised as the validation set is, by name."""

    @property
    def n_train_tokens(self) -> int:
        return int(sum(len(x) for x in self.train["input_ids"]))

    @property
    def n_val_tokens(self) -> int:
        return int(sum(len(x) for x in self.val["input_ids"]))


def label_names(train, val, where: str = "validation") -> tuple[list[str], dict]:
    """The class names and a value -> id map, from a `ClassLabel` feature or the training set's sorted distinct
    values. Labels are all numbers or all strings (`1` and `"1"` would be two classes of one name), and the validation
    set (`val`, named `where` in errors) has no label the training set lacks (a class the model never trains on)."""
    feature = train.features["label"]
    if hasattr(feature, "names"):
        return list(feature.names), {i: i for i in range(len(feature.names))}
    splits = {"training": list(train["label"]), where: list(val["label"])}
    if any(v is None or (isinstance(v, float) and not math.isfinite(v)) for v in splits["training"] + splits[where]):
        raise DataError("data.label_field: a label is missing (null) or NaN")
    kinds = {part: {"strings" if isinstance(v, str) else "booleans" if isinstance(v, bool) else "numbers"
                    for v in values} for part, values in splits.items()}
    mixed = kinds["training"] | kinds[where]
    if len(mixed) > 1:  # `true` beside 1 would be one class under two names, as "1" beside 1
        said = ", ".join(f"{part}: {' and '.join(sorted(k))}" for part, k in kinds.items() if k)
        raise DataError(f"data.label_field: the labels mix {' and '.join(sorted(mixed))} ({said}); write every label "
                        f"one way")
    distinct = sorted(set(splits["training"]))
    unknown = set(splits[where]) - set(distinct)
    if unknown:
        said = "the validation set" if where == "validation" else where
        raise DataError(f"data.label_field: {said} has label(s) the training set lacks: "
                        f"{', '.join(map(str, sorted(unknown)[:5]))}")
    names = [str(int(v)) if isinstance(v, float) and v.is_integer() else str(v) for v in distinct]
    return names, {v: i for i, v in enumerate(distinct)}


def build_labelled_text(cfg: DataCfg, tokenizer_dir: Path | None = None) -> LabelledTextData:
    """Documents with labels -> tokenizer -> each document's first `seq_len` token ids -> (train, val)."""
    src = cfg.sources()[0]
    # lra_retrieval: each document of a pair gets half the sequence, less the separator between them
    doc_len = (cfg.seq_len - 1) // 2 if cfg.source == "lra_retrieval" else None
    docs = load_source(src, label_field=cfg.label_field, cache_dir=cfg.cache_dir, doc_len=doc_len)
    if cfg.val_files:
        val = load_source(src, files=cfg.val_files, key="data.val_files", label_field=cfg.label_field,
                          cache_dir=cfg.cache_dir)
        train = docs
    elif cfg.val_split:
        val = load_source(src, split=cfg.val_split, label_field=cfg.label_field, cache_dir=cfg.cache_dir,
                          doc_len=doc_len)
        train = docs
    else:
        n_val = max(1, round(len(docs) * cfg.val_fraction))
        if n_val >= len(docs):
            raise DataError(f"{len(docs)} documents are too few for data.val_fraction={cfg.val_fraction}")
        split = docs.train_test_split(test_size=n_val, seed=cfg.split_seed, shuffle=True)
        train, val = split["train"], split["test"]
    extra = {name: eval_set_documents(cfg, name, label_field=cfg.label_field, doc_len=doc_len)
             for name in cfg.eval_sets}
    names, index = label_names(train, val)
    for name, docs in extra.items():  # a label the training set lacks is refused, as in the validation set
        label_names(train, docs, f"data.eval_sets.{name}")
    if len(names) < 2:
        raise DataError(f"data.label_field: only one class ({names[0]!r}) in the labels: a classifier needs at least "
                        f"two")
    tokenizer = build_tokenizer(cfg, train, tokenizer_dir)
    dtype = token_dtype(tokenizer)
    json_labels = type(train.features["label"]).__name__ == "Json"

    def tokenize(table):
        with counted(table["text"]):
            ids = encode(table["text"], tokenizer, None, dtype, max_len=cfg.seq_len)
        values = table["label"].to_pylist()
        if json_labels:  # datasets keeps a column of mixed JSON types as JSON text (its `Json` feature)
            values = [json.loads(v) for v in values]
        labels = np.array([index[v] for v in values], dtype=np.int64)
        return pa.table({"input_ids": ids, "labels": labels})

    def prepare(ds, what):
        with tokenizing(ds, f"tokenizing {what}", cfg.num_proc):
            out = ds.with_format("arrow").map(tokenize, batched=True, remove_columns=ds.column_names,
                                              num_proc=cfg.num_proc, desc=f"tokenizing {what}")
        return out.with_format("numpy")

    return LabelledTextData(prepare(train, "train"), prepare(val, "validation"), tokenizer, len(names), names,
                            cfg.seq_len, tokenizer.pad_token_id, {name: prepare(d, name) for name, d in extra.items()})


def collate_labelled_text(pad_token_id: int):
    """Examples -> `input_ids (B, L)` right-padded to the batch's longest, `attention_mask (B, L)`, `labels (B,)`."""

    def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(e["input_ids"]) for e in examples)
        ids = np.full((len(examples), longest), pad_token_id, dtype=np.int64)
        mask = np.zeros((len(examples), longest), dtype=np.int64)
        for row, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[row, :n] = e["input_ids"]
            mask[row, :n] = 1
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                "labels": torch.as_tensor(np.array([e["labels"] for e in examples]), dtype=torch.long)}

    return collate
