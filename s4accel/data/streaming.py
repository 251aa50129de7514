"""Corpora larger than memory (`data.streaming`): documents read as a `datasets` iterable dataset, each process its
own share (`split_dataset_by_node`: by shard when the shards divide evenly, else by example, never overlapping),
tokenised and packed on the fly, several sources mixed block by block with a seeded generator.

Resuming is exact: a `TokenStream`'s state (each source's `datasets` position after its last document read, the
tokens read but not yet packed into a block, the mixing generator, the blocks of every source seen) is part of
every checkpoint, gathered from all processes, so a resumed run sees exactly the blocks an uninterrupted run sees.
Memory stays flat: a stream holds one batch of documents and less than one block of leftover tokens per source.
"""

from __future__ import annotations

import copy
import errno

import datasets
import numpy as np
import torch
from accelerate.utils import gather_object
from datasets.distributed import split_dataset_by_node

from ..config import DataCfg
from ..errors import DataError
from .sources import datasets_read_errors, disk_full_error, load_source
from .text import TextData, to_blocks, validation_documents
from .tokenize import build_tokenizer, encode, pack, token_dtype

READ_BATCH = 256
"""Documents read and tokenised together (one Rust/NumPy call per batch)."""


class SourceStream:
    """One source's documents -> blocks of `seq_len` tokens, in order, across document boundaries. Its position is
    the `datasets` state after the last document it read plus the leftover tokens, so it can be saved at any block."""

    def __init__(self, docs, tokenizer, seq_len: int, read_batch: int = READ_BATCH, key: str = "data.files",
                 where: str = "the stream"):
        self.docs, self.tokenizer, self.seq_len, self.read_batch = docs, tokenizer, seq_len, read_batch
        self.key, self.where = key, where  # what an error names: the recipe key and the source
        self.eos, self.dtype = tokenizer.eos_token_id, token_dtype(tokenizer)
        self.epoch = 0
        self.position = None  # the datasets state to restart from (None: the beginning of the epoch)
        self.leftover = np.zeros(0, self.dtype)  # tokens read but not yet in a block
        self.ready: list[np.ndarray] = []  # blocks packed but not yet handed out
        self.iterator = None
        self.docs_read = 0  # documents read since the beginning (all epochs)

    def next_block(self) -> np.ndarray:
        """The next block; at the end of the source, the next epoch's first (the leftover of the last is dropped)."""
        self.peek()
        return self.ready.pop(0)

    def peek(self) -> None:
        """Read until a block is ready. A whole pass over the source that yields none (fewer than `seq_len` tokens:
        a file shorter than a block, or one the validation head used up) is an error, not an endless loop."""
        start = self.epoch
        while not self.ready:
            self._read()
            if self.epoch > start + 1:  # a pass from its beginning to its end gave no block
                raise DataError(f"the training stream holds less than one block of data.seq_len={self.seq_len} "
                                f"tokens ({self.docs_read} documents read in all, the validation head's and other "
                                f"processes' shares not counted): add data or lower data.seq_len")

    def _read(self):
        if self.iterator is None:
            self.docs.set_epoch(self.epoch)
            if self.position is not None:
                self.docs.load_state_dict(self.position)
            self.iterator = iter(self.docs)
        texts = []
        with datasets_read_errors() as errors:
            try:
                for example in self.iterator:
                    texts.append(example["text"])
                    if len(texts) == self.read_batch:
                        break
            except (OSError, ValueError, UnicodeDecodeError) as e:  # pyarrow's ArrowInvalid is a ValueError
                raise self._unreadable(e, errors.file, self.docs_read + len(texts)) from None
        if not texts:  # the source is exhausted: the next epoch starts over
            self.epoch += 1
            self.position, self.iterator, self.leftover = None, None, np.zeros(0, self.dtype)
            return
        self.position = self.docs.state_dict()  # after these documents
        self.docs_read += len(texts)
        tokens = np.concatenate([self.leftover, pack(encode(texts, self.tokenizer, self.eos, self.dtype), 1)[:, 0]])
        n = len(tokens) // self.seq_len
        self.ready = list(tokens[: n * self.seq_len].reshape(n, self.seq_len))
        self.leftover = tokens[n * self.seq_len:]

    def _unreadable(self, e: BaseException, file: str | None, docs: int) -> DataError:
        """A file the stream reaches only now (a bad line deep in it, or a later file) stops the run with one line
        naming it; the last checkpoint is the one to resume from once the file is mended."""
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return disk_full_error(None)
        what = f"{file}: " if file else f"{self.where}: "
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return DataError(f"{self.key}: {what}a streamed file could not be read ({detail}), after {docs} documents "
                         f"of epoch {self.epoch}: mend or remove it, then resume")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": copy.deepcopy(self.position),
                "leftover": torch.from_numpy(self.leftover.astype(np.int64)),
                "ready": torch.from_numpy(np.stack(self.ready).astype(np.int64)) if self.ready else None}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], copy.deepcopy(state["position"])
        self.leftover = state["leftover"].numpy().astype(self.dtype)
        self.ready = list(state["ready"].numpy().astype(self.dtype)) if state["ready"] is not None else []
        self.iterator = None  # reopened at `position` on the next read


class TokenStream(torch.utils.data.IterableDataset):
    """This process's training blocks, endless: one source, or several mixed by weight (a seeded generator picks
    each block's source). Also a checkpointed object (`state_dict`/`load_state_dict`, gathered over processes), and a
    window's rewind point (`snapshot`/`restore`)."""

    resumable = True  # the loop restores its position from the checkpoint instead of skipping batches

    def __init__(self, sources: list[SourceStream], weights: list[float], seed: int, labels: list[str],
                 accelerator=None):
        self.sources, self.labels, self.accelerator = sources, labels, accelerator
        self.weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.blocks_seen = np.zeros(len(sources), dtype=np.int64)

    def __iter__(self):
        while True:
            i = 0 if len(self.sources) == 1 else int(self.rng.choice(len(self.sources), p=self.weights))
            block = self.sources[i].next_block()
            self.blocks_seen[i] += 1
            yield {"input_ids": torch.from_numpy(block.astype(np.int64))}

    def tokens_seen(self) -> dict[str, int]:
        seq_len = self.sources[0].seq_len
        return {label: int(n) * seq_len for label, n in zip(self.labels, self.blocks_seen)}

    def _own_state(self) -> dict:
        return {"sources": [s.state_dict() for s in self.sources], "rng": copy.deepcopy(self.rng.bit_generator.state),
                "blocks_seen": torch.from_numpy(self.blocks_seen.copy())}

    def _load_own(self, state: dict) -> None:
        for s, sd in zip(self.sources, state["sources"]):
            s.load_state_dict(sd)
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])
        self.blocks_seen = state["blocks_seen"].numpy().copy()

    # Checkpointing: every process calls state_dict (Accelerate's save_state) and the main process writes it, so
    # each process's state is gathered into the one written.
    def state_dict(self) -> dict:
        own = self._own_state()
        if self.accelerator is None or self.accelerator.num_processes == 1:
            return {"processes": [own]}
        return {"processes": gather_object([own])}

    def load_state_dict(self, state: dict) -> None:
        rank = self.accelerator.process_index if self.accelerator is not None else 0
        if len(state["processes"]) <= rank:
            raise DataError(f"the checkpoint's data stream was saved by {len(state['processes'])} process(es); this "
                            f"run has more")
        self._load_own(state["processes"][rank])

    def snapshot(self):
        return self._own_state()

    def restore(self, snap) -> None:
        self._load_own(snap)


def build_stream_data(cfg: DataCfg, tokenizer_dir, seed: int, rank: int, world_size: int):
    """TextData whose `train` is this process's `TokenStream` and whose `val` is map-style blocks: the validation set
    of its own, or the first `val_blocks` blocks of the (single) source, which the stream then skips."""

    sources = cfg.sources()
    streams = [load_source(s, cache_dir=cfg.cache_dir, streaming=True) for s in sources]
    if cfg.tokenizer == "bpe" and not (tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").exists()):
        raise DataError("data.tokenizer: bpe is trained on the whole training split, which a stream never holds; "
                        "train it once without streaming (or use byte or a tokenizer of your own)")
    tokenizer = build_tokenizer(cfg, None, tokenizer_dir)
    val_docs = validation_documents(cfg)
    if val_docs is not None:
        val = to_blocks(val_docs, tokenizer, cfg.seq_len, cfg.num_proc, " (validation)")
    else:  # the head of the (whole, single) stream; training starts at the first document after it
        if len(sources) > 1:
            raise DataError("data.mixture with data.streaming needs a validation set of its own (data.val_files)")
        head = SourceStream(streams[0], tokenizer, cfg.seq_len, read_batch=16, key=_key(sources[0]),
                            where=sources[0].label)  # few documents past the head
        rows = [head.next_block() for _ in range(cfg.val_blocks)]
        if head.epoch > 0:
            raise DataError(f"data.val_blocks={cfg.val_blocks}: the stream holds fewer blocks than that")
        val = datasets.Dataset.from_dict({"input_ids": np.stack(rows)}).with_format("numpy")
        streams[0] = streams[0].skip(head.docs_read)
    mine = [SourceStream(split_dataset_by_node(s, rank, world_size), tokenizer, cfg.seq_len, key=_key(src),
                         where=src.label) for s, src in zip(streams, sources)]
    for stream in mine:  # too little data is an error now, before the model is built (the block stays ready)
        stream.peek()
    train = TokenStream(mine, [s.weight for s in sources], seed + rank, [s.label for s in sources])
    return TextData(train, val, tokenizer, None, len(val) * cfg.seq_len)


def _key(src) -> str:
    return "data.files" if src.source == "files" else "data.path" if src.source == "dataset" else "data.source"
