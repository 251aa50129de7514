"""One streamed source's documents -> blocks of `seq_len` tokens, packed across document boundaries, read shard by
shard (a shard: one of the source's files, or a part `datasets` reads on its own), in file order or in an order
shuffled anew each pass. Its position can be saved at any block and restored exactly."""

from __future__ import annotations

import bisect
import copy
import errno
import itertools
import math

import numpy as np
import torch

from ..errors import DataError
from .sources import datasets_read_errors, disk_full_error
from .tokenize import encode, pack, token_dtype

READ_BATCH = 256
"""Documents read and tokenised together (one Rust/NumPy call per batch)."""


class Shards:
    """A `datasets` stream's shards (its files, or the parts `datasets` reads on its own), each opened as a stream of
    its own, in any order; without the stream's first `skip` documents (the validation head's, never trained on): the
    shards the head used up are left out, the one it stopped in is opened past its documents (counted by reading them
    again).

    `IterableDataset.shard(n, k)` lists all n shards to pick one (O(n) each time: 3 ms at 2,000 files), so a pass
    opening every shard that way would cost O(n^2); the shards are reached through about sqrt(n) groups of
    consecutive shards instead, each listed once when first needed: O(n sqrt n) a pass (0.5 ms a shard at 2,000; a
    pass over 2,000 one-document files took 1.3 s, against 0.3 s for `datasets` reading them in one go)."""

    def __init__(self, docs, skip: int = 0):
        self.docs, n = docs, docs.num_shards
        self.groups = max(1, math.isqrt(n))
        # shard(groups, g) gives the first n % groups groups one shard more (its documented split)
        sizes = [n // self.groups + (g < n % self.groups) for g in range(self.groups)]
        self.starts = list(itertools.accumulate(sizes, initial=0))
        self.opened: dict[int, object] = {}
        self.first, self.skip = 0, skip
        while self.skip and self.first < n:
            held = sum(1 for _ in itertools.islice(self._open(self.first), self.skip))
            if held == self.skip:
                break
            self.skip -= held  # used up by the head
            self.first += 1
        self.count = n - self.first

    def _open(self, k: int):
        g = bisect.bisect_right(self.starts, k) - 1
        if g not in self.opened:
            self.opened[g] = self.docs.shard(self.groups, g) if self.groups > 1 else self.docs
        group = self.opened[g]
        return group.shard(group.num_shards, k - self.starts[g]) if group.num_shards > 1 else group

    def open(self, k: int):
        """The k-th shard left to train on, as a stream."""
        shard = self._open(self.first + k)
        return shard.skip(self.skip) if k == 0 and self.skip else shard


class Whole:
    """A stream read as one shard, in its own order."""

    count = 1

    def __init__(self, docs):
        self.docs = docs

    def open(self, k: int):
        return self.docs


class SourceStream:
    """Blocks of one source, in order, across document boundaries. `shards`: `Shards` or `Whole`. `seed` None: the
    shards in file order every pass; otherwise in an order drawn from (seed, pass). Its position: the pass, the shard being read and its `datasets` state after the last document read,
    the leftover tokens and the blocks packed but not yet handed out."""

    def __init__(self, shards: Shards | Whole, tokenizer, seq_len: int, seed: list[int] | None = None,
                 read_batch: int = READ_BATCH, key: str = "data.files", where: str = "the stream",
                 datasets_epochs: bool = False):
        self.shards, self.n_shards, self.seed = shards, shards.count, seed
        # datasets (5.x) reads the shards of a stream whose `set_epoch` is past 0 in an order of its own: told only
        # by an earlier version's streams, which it read that way
        self.datasets_epochs = datasets_epochs
        self.tokenizer, self.seq_len, self.read_batch = tokenizer, seq_len, read_batch
        self.key, self.where = key, where  # what an error names: the recipe key and the source
        self.eos, self.dtype = tokenizer.eos_token_id, token_dtype(tokenizer)
        self.epoch = 0
        self.shard = 0  # the shard being read: its place in this pass's order
        self.position = None  # its datasets state to restart from (None: its beginning)
        self.leftover = np.zeros(0, self.dtype)  # tokens read but not yet in a block
        self.ready: list[np.ndarray] = []  # blocks packed but not yet handed out
        self.docs, self.iterator, self._order = None, None, (None, None)
        self.docs_read = 0  # documents read since the beginning (all passes)

    def order(self, epoch: int) -> list[int]:
        """The shards of a pass, in the order they are read."""
        if self._order[0] != epoch:
            order = range(self.n_shards) if self.seed is None else \
                np.random.default_rng([*self.seed, epoch]).permutation(self.n_shards)
            self._order = (epoch, [int(k) for k in order])
        return self._order[1]

    def next_block(self) -> np.ndarray:
        """The next block; at the end of the source, the next pass's first (the leftover of the last is dropped)."""
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
                                f"tokens ({self.docs_read} documents read in all, the validation head's not "
                                f"counted): add data or lower data.seq_len")

    def _read(self):
        if self.n_shards == 0:  # the validation head used up the source: every pass is empty
            self.epoch += 1
            return
        if self.iterator is None:
            self.docs = self.shards.open(self.order(self.epoch)[self.shard])
            if self.datasets_epochs:
                self.docs.set_epoch(self.epoch)
            if self.position is not None:
                # On a copy: a shard may be the same stream object every pass (a single file), and a state loaded
                # into it would start every later pass there too (an empty pass: "less than one block").
                self.docs = copy.deepcopy(self.docs)
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
        if not texts:  # this shard is read: the next one, or at the end of the pass the next pass from the start
            self.shard, self.position, self.iterator = self.shard + 1, None, None
            if self.shard == self.n_shards:
                self.epoch, self.shard, self.leftover = self.epoch + 1, 0, np.zeros(0, self.dtype)
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
        return {"epoch": self.epoch, "shard": self.shard, "position": copy.deepcopy(self.position),
                "leftover": torch.from_numpy(self.leftover.astype(np.int64)),
                "ready": torch.from_numpy(np.stack(self.ready).astype(np.int64)) if self.ready else None}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], copy.deepcopy(state["position"])
        self.shard = state.get("shard", 0)  # a state saved before sources were read shard by shard: one shard
        self.leftover = state["leftover"].numpy().astype(self.dtype)
        self.ready = list(state["ready"].numpy().astype(self.dtype)) if state["ready"] is not None else []
        self.iterator = None  # reopened at `position` on the next read
