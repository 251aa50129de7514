"""Text for a language model: documents (one source or a weighted mixture) -> tokenizer -> packed blocks.

    documents (sources.py: the plays, your files, any `datasets` source)
      -> tokenise, EOS after each document, and cut each batch of 1,000 documents' concatenation into seq_len blocks
         (tokenize.py, on Arrow buffers; `datasets.map`, cached on disk for file-backed data)
      -> validation: a set of its own (`val_files`, `val_split`), or the last `val_fraction` of each source's blocks
         (the end of its last documents: for the built-in plays, whole plays the model never trains on)
      -> a mixture: the sources' blocks interleaved by weight, seeded (`datasets.interleave_datasets`)
      -> more evaluation sets (`eval_sets`): each read and packed as a validation set of its own is

With `data.streaming` the training blocks come from `streaming.py` instead, read and packed on the fly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np

from ..config import DataCfg, SourceCfg
from ..errors import DataError
from .progress import counted, tokenizing
from .sources import load_source
from .tokenize import blocks_table, build_tokenizer, encode, pack, token_dtype

PACK_BATCH = 1000
"""Documents tokenised and packed together: one batch's remainder (< seq_len tokens) is dropped, so little is lost
(less than one block per 1,000 documents)."""


@dataclass
class TextData:
    train: object
    """`datasets.Dataset` of `{"input_ids": (seq_len,)}` blocks (numpy format), or a `TokenStream` (streaming)."""
    val: object
    tokenizer: object
    n_train_tokens: int | None
    """None for a stream (its length is known only once it has been read)."""
    n_val_tokens: int
    source_tokens: dict[str, int] = field(default_factory=dict)
    """Training tokens per source of a mixture (map-style), for the run's summary."""
    notes: list[str] = field(default_factory=list)
    """What the run should say about its data at the start, one line each."""
    eval_sets: dict = field(default_factory=dict)
    """`data.eval_sets`, each as packed blocks (map-style, also when training streams), by name."""


def validation_documents(cfg: DataCfg, streaming: bool = False):
    """The validation set of its own (`val_files` or `val_split`), or None."""
    src = cfg.sources()[0]
    if cfg.val_files:
        return load_source(src, files=cfg.val_files, key="data.val_files", cache_dir=cfg.cache_dir,
                           streaming=streaming)
    if cfg.val_split:
        return load_source(src, split=cfg.val_split, cache_dir=cfg.cache_dir, streaming=streaming)
    return None


def eval_set_documents(cfg: DataCfg, name: str, **kwargs):
    """The documents of `data.eval_sets.<name>`: files read as `data.val_files` are, or another split of the source
    (`kwargs`: `load_source`'s, e.g. the label column)."""
    spec, src = cfg.eval_sets[name], cfg.sources()[0]
    if spec.files:
        return load_source(src, files=spec.files, key=f"data.eval_sets.{name}.files", cache_dir=cfg.cache_dir,
                           **kwargs)
    return load_source(src, split=spec.split, cache_dir=cfg.cache_dir, **kwargs)


def eval_set_blocks(cfg: DataCfg, tokenizer) -> dict:
    """Each of `data.eval_sets` packed into blocks as the validation set is, by name."""
    out = {}
    for name in cfg.eval_sets:
        out[name] = to_blocks(eval_set_documents(cfg, name), tokenizer, cfg.seq_len, cfg.num_proc, f" ({name})")
        if len(out[name]) == 0:
            raise DataError(f"data.eval_sets.{name}: the set makes no block of data.seq_len={cfg.seq_len} tokens; "
                            f"add text or shorten seq_len")
    return out


def to_blocks(docs, tokenizer, seq_len: int, num_proc: int | None = None, desc: str = ""):
    """Documents -> packed blocks (a dataset of fixed-size `input_ids` rows, numpy format)."""
    eos, dtype = tokenizer.eos_token_id, token_dtype(tokenizer)

    def tokenize_and_pack(table):
        with counted(table["text"]):
            return blocks_table(pack(encode(table["text"], tokenizer, eos, dtype), seq_len))

    what = f"tokenizing and packing {seq_len}{desc}"
    with tokenizing(docs, what, num_proc):
        blocks = docs.with_format("arrow").map(tokenize_and_pack, batched=True, batch_size=PACK_BATCH,
                                               remove_columns=docs.column_names, num_proc=num_proc, desc=what)
    return blocks.with_format("numpy")


def build_text_data(cfg: DataCfg, tokenizer_dir: Path | None = None, seed: int = 0) -> TextData:
    """Documents -> tokenizer -> packed blocks -> (train, val), map-style (`streaming.py` builds the streamed kind).
    Call under `accelerator.main_process_first()` so the main process fills the `datasets` cache (and trains the
    BPE) and the others read it. `seed`: a mixture's interleaving."""
    sources = cfg.sources()
    docs = [load_source(s, cache_dir=cfg.cache_dir) for s in sources]
    tokenizer = build_tokenizer(cfg, docs[0], tokenizer_dir)
    val_docs = validation_documents(cfg)
    trains, vals = [], []
    for src, d in zip(sources, docs):
        blocks = to_blocks(d, tokenizer, cfg.seq_len, cfg.num_proc, f" ({src.label})" if len(sources) > 1 else "")
        n_val = 0 if val_docs is not None else math.ceil(len(blocks) * cfg.val_fraction)
        if len(blocks) - n_val < 1:
            raise DataError(f"{src.label}: the data makes only {len(blocks)} block(s) of data.seq_len={cfg.seq_len} "
                            f"tokens: too few for a train split and a validation split (val_fraction="
                            f"{cfg.val_fraction}); add text or shorten seq_len")
        trains.append(blocks.select(range(len(blocks) - n_val)) if n_val else blocks)
        if n_val:
            vals.append(blocks.select(range(len(blocks) - n_val, len(blocks))))
    val = to_blocks(val_docs, tokenizer, cfg.seq_len, cfg.num_proc, " (validation)") if val_docs is not None \
        else concatenate(vals)
    if len(val) == 0:
        raise DataError(f"the validation set makes no block of data.seq_len={cfg.seq_len} tokens; add text or shorten "
                        f"seq_len")
    train, counts = mix(trains, sources, seed, cfg.seq_len)
    return TextData(train, val, tokenizer, len(train) * cfg.seq_len, len(val) * cfg.seq_len, counts,
                    eval_sets=eval_set_blocks(cfg, tokenizer))


def concatenate(parts):
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts).with_format("numpy")


def mix(trains: list, sources: list[SourceCfg], seed: int, seq_len: int):
    """One source: its blocks. Several: blocks interleaved with probabilities from the weights (seeded; a source
    that runs out first starts again, so every source's blocks are all seen and the shares stay the weights), and
    the training tokens of each source."""
    if len(trains) == 1:
        return trains[0], {}
    weights = np.array([s.weight for s in sources], dtype=np.float64)
    tagged = [t.add_column("source", np.full(len(t), i, dtype=np.int64)) for i, t in enumerate(trains)]
    train = datasets.interleave_datasets(tagged, probabilities=(weights / weights.sum()).tolist(), seed=seed,
                                         stopping_strategy="all_exhausted")
    counts = np.bincount(np.asarray(train["source"]), minlength=len(sources))
    labels = [s.label for s in sources]
    return train.remove_columns("source").with_format("numpy"), {
        label: int(c) * seq_len for label, c in zip(labels, counts)}
