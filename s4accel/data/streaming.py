"""Corpora larger than memory (`data.streaming`): documents read as `datasets` iterable datasets, tokenised and
packed on the fly (`source_stream.py`), shuffled (`shuffle_buffer.py`), several sources mixed block by block.

One sequence of blocks, dealt out. Every process reads and packs the whole stream the same way (the shards' order,
the shuffle buffer and the mixing generator are seeded by `run.seed` alone) into one global sequence of blocks, and
takes every P-th: block i goes to process i mod P. So a micro-step of P processes trains on P consecutive blocks and
an optimizer step on the next `processes x data.batch_size x train.grad_accum` blocks, however many processes deal
them out, as a map-style epoch's examples are (training/world.py). Every process stands at the same place in it
after each of its blocks, so the checkpoint holds one position, the same on every process and for any number of
processes: a run resumes on another number with the same global batch and trains every later step on the blocks of
the run that never stopped.

Its cost, and why it was chosen: every process reads and tokenises the whole corpus to hand out 1/P of it. Reading
was mostly paid already: `split_dataset_by_node`, which gave each process a share of its own before, splits by
example whenever the shards do not divide evenly between the processes (a single file always), and each process
then read every example to keep its share; tokenising is what is now done P times. Measured with `bench/stream.py`
(2 CPU cores shared with other work, seq_len 256; tokens per second each process hands out, before -> after, with
the default shuffle; the byte figures vary by up to half from run to run here):

    tokenizer, corpus       1 process         2 processes
    byte, 1 file (40 MB)    41M -> 24M        23M -> 12M
    byte, 8 files           53M -> 24M        28M -> 19M
    BPE, 1 file (10 MB)     0.99M -> 0.80M    1.03M -> 0.33M
    BPE, 8 files            0.93M -> 0.67M    1.07M -> 0.37M

(in file order, `shuffle_buffer: 0`, BPE hands out 0.93M with 1 process and 0.45M each with 2: the buffer costs a few
microseconds a block, and here it also read its 1,024 blocks ahead inside the short timed run). So with a subword
tokenizer each process gets 1/P of one core's tokenising; with bytes it hardly matters. The quick-start trains on
~17,800 tokens/s on 2 cores; a subword tokenizer feeding several fast GPUs is where this shows (tokenise once,
map-style, there). Against that cost, a share per process made the sequence of blocks, and so the run, depend on the
number of processes. A fixed number of virtual shares ("lanes", each packed on its own and dealt out in turn, as
MosaicML's streaming fixes its "canonical nodes") would keep tokenising at 1/P, but must be fixed for the life of a
run, divide every number of processes it may run on, and read every example once per lane a process holds when the
lanes split a source by example; the one sequence needs none of that, and is what a single process reads.

Shuffling (`data.shuffle_buffer`, on by default): each pass reads the shards in an order drawn from the seed and the
pass (a corpus sorted by path no longer trains on one package after another), and a buffer of blocks hands them out
in a seeded random order. Both are part of the position; the buffer's blocks are saved with it. On the plays' 698
scenes as files sorted by genre and play (the quick-start recipe, 100 steps, every 10th scene held out) the stream
read in file order reached 3.352 bits per byte, shuffled 3.224, map-style data 3.220.

Resuming is exact: a `TokenStream`'s state (each source's shard, its `datasets` position after its last document
read, the tokens read but not yet packed into a block, the shuffle buffers' blocks, the mixing generator, the blocks
of each source seen) is saved in every checkpoint. Memory stays flat: a stream holds one batch of documents, less
than one block of leftover tokens per source and its shuffle buffer.

Checkpoints of earlier versions hold one position per process (each reading its own share, unshuffled): they resume
on as many processes, reading the same shares as they did, with `data.shuffle_buffer: 0`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import datasets
import numpy as np
import torch
from accelerate.utils import gather_object
from datasets.distributed import split_dataset_by_node

from ..config import DataCfg
from ..errors import DataError, ResumeError
from .shuffle_buffer import ShuffleBuffer
from .source_stream import Shards, SourceStream, Whole
from .sources import load_source
from .text import TextData, eval_set_blocks, to_blocks, validation_documents
from .tokenize import build_tokenizer


class TokenStream(torch.utils.data.IterableDataset):
    """This process's training blocks, endless: every P-th block of the global sequence of one source, or of several
    mixed by weight (a seeded generator picks each block's source). Also a checkpointed object (`state_dict`/
    `load_state_dict`), and a window's rewind point (`snapshot`/`restore`)."""

    resumable = True  # the loop restores its position from the checkpoint instead of skipping batches

    def __init__(self, sources: list[SourceStream], weights: list[float], seed: int, labels: list[str],
                 buffer: int = 0, rank: int = 0, processes: int = 1, per_process=None):
        self.sources, self.labels = sources, labels
        self.rank, self.processes = rank, processes
        self.weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.buffer = buffer
        self.buffers = [ShuffleBuffer(buffer, [seed, i], s.dtype) for i, s in enumerate(sources)] if buffer else []
        self.blocks_seen = np.zeros(len(sources), dtype=np.int64)  # global blocks of each source handed out
        self.per_process = per_process  # (rank, processes) -> an earlier version's per-process sources
        self.shares = False  # reading an earlier version's share of this process (set by its checkpoint)
        self.accelerator = None  # to gather the per-process states of an earlier version's checkpoint

    def _next(self) -> np.ndarray:
        """The next block of the global sequence."""
        i = 0 if len(self.sources) == 1 else int(self.rng.choice(len(self.sources), p=self.weights))
        block = self.buffers[i].take(self.sources[i]) if self.buffers else self.sources[i].next_block()
        self.blocks_seen[i] += 1
        return block

    def __iter__(self):
        while True:
            if self.shares:  # an earlier version's share of this process: all its blocks are its own
                block = self._next()
            else:  # every process reads the same P blocks and keeps its own
                block = [self._next() for _ in range(self.processes)][self.rank]
            yield {"input_ids": torch.from_numpy(block.astype(np.int64))}

    def tokens_seen(self) -> tuple[dict[str, int], str]:
        """Tokens handed out per source, and by whom (all processes; this one for an earlier version's share)."""
        seq_len = self.sources[0].seq_len
        return ({label: int(n) * seq_len for label, n in zip(self.labels, self.blocks_seen)},
                "this process" if self.shares else "all processes")

    def _own_state(self) -> dict:
        return {"shuffle_buffer": self.buffer, "sources": [s.state_dict() for s in self.sources],
                "buffers": [b.state_dict() for b in self.buffers],
                "rng": copy.deepcopy(self.rng.bit_generator.state),
                "blocks_seen": torch.from_numpy(self.blocks_seen.copy())}

    def _load_own(self, state: dict) -> None:
        for s, sd in zip(self.sources, state["sources"]):
            s.load_state_dict(sd)
        for b, sd in zip(self.buffers, state.get("buffers", [])):
            b.load_state_dict(sd)
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])
        self.blocks_seen = state["blocks_seen"].numpy().copy()

    def state_dict(self) -> dict:
        """One position, the same on every process (each has read the same blocks): Accelerate's save_state calls
        this on every process and the main process writes it. An earlier version's shares stay one per process."""
        if self.shares:
            own = self._own_state()
            many = self.accelerator is not None and self.accelerator.num_processes > 1
            return {"processes": gather_object([own]) if many else [own]}
        return {"stream": self._own_state()}

    def load_state_dict(self, state: dict) -> None:
        if "stream" in state:
            saved = state["stream"]["shuffle_buffer"]
            if saved != self.buffer:  # how the shards are read and the blocks the buffer holds are its position
                raise ResumeError(f"the checkpoint's data stream was read with data.shuffle_buffer={saved}, which "
                                  f"cannot change mid-stream: resume with --set data.shuffle_buffer={saved}")
            self._load_own(state["stream"])
            return
        saved = len(state["processes"])  # an earlier version's checkpoint: one share per process
        if saved != self.processes:
            raise ResumeError(per_process_refusal(saved))
        if self.buffers:
            raise ResumeError(f"the checkpoint's data stream was saved by an earlier s4accel, which read streams "
                              f"unshuffled: resume it with --set data.shuffle_buffer=0")
        self.sources, self.shares = self.per_process(self.rank, self.processes), True
        self._load_own(state["processes"][self.rank])

    def snapshot(self):
        return self._own_state()

    def restore(self, snap) -> None:
        self._load_own(snap)


def per_process_refusal(saved: int) -> str:
    return (f"the checkpoint's data stream was saved by an earlier s4accel in one share per process, which cannot be "
            f"dealt out again; resume on {saved} process(es), with --set data.shuffle_buffer=0")


def saved_per_process(state) -> int | None:
    """How many processes a saved `TokenStream` state was read by one share each (an earlier version's); None for
    any other state."""
    if isinstance(state, dict) and isinstance(state.get("processes"), list) and state["processes"] and \
            isinstance(state["processes"][0], dict) and "sources" in state["processes"][0]:
        return len(state["processes"])
    return None


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
    head_docs = 0  # documents of the (single) source read for validation
    if val_docs is not None:
        val = to_blocks(val_docs, tokenizer, cfg.seq_len, cfg.num_proc, " (validation)")
    else:  # the head of the (whole, single) stream in file order; training starts at the first document after it
        if len(sources) > 1:
            raise DataError("data.mixture with data.streaming needs a validation set of its own (data.val_files)")
        head = SourceStream(Whole(streams[0]), tokenizer, cfg.seq_len, read_batch=16, key=_key(sources[0]),
                            where=sources[0].label)  # few documents past the head
        rows = [head.next_block() for _ in range(cfg.val_blocks)]
        if head.epoch > 0:
            raise DataError(f"data.val_blocks={cfg.val_blocks}: the stream holds fewer blocks than that")
        val = datasets.Dataset.from_dict({"input_ids": np.stack(rows)}).with_format("numpy")
        head_docs = head.docs_read

    def read(shards, i, seed=None, datasets_epochs=False):
        return SourceStream(shards, tokenizer, cfg.seq_len, seed, key=_key(sources[i]), where=sources[i].label,
                            datasets_epochs=datasets_epochs)

    def after_head(i: int):
        return streams[i].skip(head_docs) if i == 0 and head_docs else streams[i]

    def per_process(r: int, world: int) -> list[SourceStream]:
        """An earlier version's sources: each process its own share of each source."""
        return [read(Whole(split_dataset_by_node(after_head(i), r, world)), i, datasets_epochs=True)
                for i in range(len(streams))]

    if cfg.shuffle_buffer:  # shard by shard, in an order drawn from the seed, the source and the pass
        mine = [read(Shards(s, head_docs if i == 0 else 0), i, [seed, i]) for i, s in enumerate(streams)]
    else:  # in file order, every pass
        mine = [read(Whole(after_head(i)), i) for i in range(len(streams))]
    for stream in mine:  # too little data is an error now, before the model is built (the block stays ready)
        stream.peek()
    train = TokenStream(mine, [s.weight for s in sources], seed, [s.label for s in sources], cfg.shuffle_buffer,
                        rank, world_size, per_process)
    # One shard is read in its own order every pass: a sorted file then trains nearly in order (reported: 4.51 bits
    # per byte at step 100 against 3.50 map-style), which the user can mend by splitting it.
    notes = [f"{_key(src)} streams as one shard ({Path(src.label).name if src.source == 'files' else src.label}): "
             f"data.shuffle_buffer={cfg.shuffle_buffer} mixes its blocks only with the next {cfg.shuffle_buffer:,} "
             f"or so; split it into several files to have its parts read in a random order"
             for src, stream in zip(sources, streams) if cfg.shuffle_buffer and stream.num_shards == 1]
    return TextData(train, val, tokenizer, None, len(val) * cfg.seq_len, notes=notes,
                    eval_sets=eval_set_blocks(cfg, tokenizer))


def _key(src) -> str:
    return "data.files" if src.source == "files" else "data.path" if src.source == "dataset" else "data.source"
