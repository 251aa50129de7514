"""Stateful training over long text streams (`train.state.mode`): each model's recurrent state carried from one chunk
of a stream into the next chunk of the same rows.

Layout: the training token stream (the packed blocks, in text order) is cut into `rows = batch_size x processes`
contiguous streams; optimizer micro-batch t holds chunk t of every stream, and process p always reads rows
`p*batch_size ... (p+1)*batch_size - 1` (never the interleaved batches of a sharded loader, which would continue
another row's text: shared NOTES.md item 14). Modes:

    tbptt   each chunk starts from the previous chunk's final state, detached (gradients stay in the chunk)
    reset   as tbptt, but the state restarts from zero every `n_context + 1` chunks
    bptt    each chunk starts from the state of re-reading the previous `n_context` chunks without gradient, with
            the current weights (exact context, `n_context` extra forward passes per chunk)

Every mode restarts from zero at the first chunk of each epoch and after each evaluation. The carried state is part
of the checkpoint (gathered from all processes), so a resumed run continues exactly.
"""

from __future__ import annotations

import copy
from collections import deque

import torch

from .config import StateCfg
from .errors import DataError


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


def stream_loader(data, batch_size: int, num_processes: int, rank: int, num_workers: int = 0):
    """This process's chunks, in order, each batch carrying its `chunk_index` (0 starts a new epoch's streams)."""
    from torch.utils.data import DataLoader

    from .data import collate_lm

    sampler = StreamBatchSampler(len(data), batch_size, num_processes, rank)
    if sampler.chunks < 1:
        raise DataError(f"stateful training needs at least one chunk per stream: {len(data)} blocks < "
                        f"{batch_size} x {num_processes} rows")

    def collate(examples, chunk_of=sampler.chunks):
        batch = collate_lm(examples)
        batch["chunk_index"] = torch.tensor(int(examples[0]["__index__"]) % chunk_of)
        return batch

    # A generator of its own: without one, every new iterator (each epoch, and the first after a resume) draws its
    # workers' base seed from the global RNG, which shifts the dropout masks of a resumed run.
    return DataLoader(_WithIndex(data), batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      generator=torch.Generator().manual_seed(0))


class _WithIndex(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {**self.data[i], "__index__": i}


class CarriedState:
    """The recurrent state between chunks, for one process. `forward(model, batch)` runs the model on a chunk from the
    right starting state and keeps what the next chunk needs."""

    def __init__(self, cfg: StateCfg, accelerator):
        self.mode, self.n_context, self.accelerator = cfg.mode, cfg.n_context, accelerator
        self.reset()

    def reset(self):
        self.cache = None  # S4Cache of the last chunk (tbptt, reset)
        self.chunks = 0  # chunks read since the last reset (reset)
        self.context: deque = deque(maxlen=self.n_context)  # previous chunks' input_ids (bptt)

    def forward(self, model, batch: dict, **kwargs):
        if int(batch.pop("chunk_index")) == 0:  # a new epoch: the streams start again
            self.reset()
        if self.mode == "reset" and self.chunks == self.n_context + 1:
            self.reset()
        if self.mode == "bptt":
            cache = None
            with torch.no_grad():  # rebuild the context's state with the current weights
                for ids in self.context:
                    cache = model(input_ids=ids, cache_params=cache, use_cache=True).cache_params
            self.context.append(batch["input_ids"])
        else:
            cache = self.cache
        out = model(**batch, cache_params=cache, use_cache=True, **kwargs)
        if self.mode != "bptt":
            self.cache = out.cache_params.detach()  # gradients stop at the chunk boundary
            self.chunks += 1
        return out

    def snapshot(self):
        """What `forward` changes, to go back to it (a window cut short by a stop signal). The model's forward sets
        new attributes on the cache it is given (its `states` list), never changes the tensors: a shallow copy keeps
        the state as it is now."""
        return copy.copy(self.cache), self.chunks, list(self.context)

    def restore(self, snap) -> None:
        self.cache, self.chunks, context = snap
        self.context.clear()
        self.context.extend(context)

    # Checkpointing: every process calls state_dict (Accelerate's save_state), the main process writes it.
    def state_dict(self) -> dict:
        gather = self.accelerator.gather
        states = None
        if self.cache is not None:  # (B, H, n) complex per layer -> all rows, as real pairs
            states = [gather(torch.view_as_real(s).contiguous()) for s in self.cache.states]
        context = [gather(ids.contiguous()) for ids in self.context]
        return {"states": states, "chunks": self.chunks, "context": context}

    def load_state_dict(self, sd: dict) -> None:
        from .models.modeling_s4 import S4Cache

        self.reset()
        n, rank = self.accelerator.num_processes, self.accelerator.process_index
        device = self.accelerator.device

        def mine(t):  # this process's rows of a gathered tensor
            rows = t.shape[0] // n
            return t[rank * rows : (rank + 1) * rows].to(device)

        if sd["states"] is not None:
            self.cache = S4Cache([torch.view_as_complex(mine(s).contiguous()) for s in sd["states"]])
        self.chunks = sd["chunks"]
        self.context.extend(mine(ids) for ids in sd["context"])
