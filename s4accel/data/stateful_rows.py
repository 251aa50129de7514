"""Long text streams for stateful training (`train.state.mode`): the training token stream (the packed blocks, in text
order) cut into `rows = batch_size x processes` contiguous streams; micro-batch t holds chunk t of every stream, and
process p always reads rows `p*batch_size ... (p+1)*batch_size - 1`. A sharded loader would interleave the batches
across processes, so a carried state would continue another row's text (the state that carries over lives in
`s4accel/training/carried_state.py`)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ..errors import DataError
from .loaders import collate_lm


class StreamBatchSampler:
    """Batches of block indices: batch t = chunk t of this process's rows. `n_blocks` packed blocks in text order."""

    def __init__(self, n_blocks: int, batch_size: int, num_processes: int, rank: int):
        rows = batch_size * num_processes
        self.chunks = n_blocks // rows  # chunks per stream; the remainder of the stream is dropped
        self.rows = range(rank * batch_size, (rank + 1) * batch_size)

    def __iter__(self):
        for t in range(self.chunks):
            yield [r * self.chunks + t for r in self.rows]

    def __len__(self):
        return self.chunks


def stream_loader(data, batch_size: int, num_processes: int, rank: int, num_workers: int = 0, collate_fn=None,
                  eos: int | None = None):
    """This process's chunks, in order, each batch carrying its `chunk_index` (0 starts a new epoch's streams).
    `collate_fn` with `eos` (packed documents, `collate_isolated`): it is told which rows continue a document from
    their previous chunk (the chunk before did not end with `eos`)."""
    sampler = StreamBatchSampler(len(data), batch_size, num_processes, rank)
    if sampler.chunks < 1:
        raise DataError(f"stateful training needs at least one chunk per stream: {len(data)} blocks < "
                        f"{batch_size} x {num_processes} rows")

    def collate(examples, chunk_of=sampler.chunks):
        chunk = int(examples[0]["__index__"]) % chunk_of
        if eos is None:
            batch = (collate_fn or collate_lm)(examples)
        else:  # a stream's first chunk starts from a zero state anyway
            continued = torch.tensor([chunk > 0 and int(e["__previous_last__"]) != eos for e in examples])
            batch = collate_fn(examples, continued)
        batch["chunk_index"] = torch.tensor(chunk)
        return batch

    # A generator of its own: without one, every new iterator (each epoch, and the first after a resume) draws its
    # workers' base seed from the global RNG, which shifts the dropout masks of a resumed run.
    return DataLoader(_WithIndex(data, previous=eos is not None), batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(0))


class _WithIndex(torch.utils.data.Dataset):
    """Each block with its index, and (`previous`, for packed documents) the last token of the block before it."""

    def __init__(self, data, previous: bool = False):
        self.data, self.previous = data, previous

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        item = {**self.data[i], "__index__": i}
        if self.previous:  # the token before this block in the stream
            item["__previous_last__"] = self.data[i - 1]["input_ids"][-1] if i else -1
        return item
