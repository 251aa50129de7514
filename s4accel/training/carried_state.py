"""The recurrent state carried from one chunk of a long text stream into the next chunk of the same rows (stateful
training, `train.state.mode`; the streams themselves: `s4accel/data/stateful_rows.py`). Modes:

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

from ..config import StateCfg
from ..models.modeling_s4 import S4Cache


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
        self.positions: deque = deque(maxlen=self.n_context)  # and their position_ids (packed documents), or None

    def forward(self, model, batch: dict, **kwargs):
        if int(batch.pop("chunk_index")) == 0:  # a new epoch: the streams start again
            self.reset()
        if self.mode == "reset" and self.chunks == self.n_context + 1:
            self.reset()
        if self.mode == "bptt":
            cache = None
            with torch.no_grad():  # rebuild the context's state with the current weights
                for ids, positions in zip(self.context, self.positions):
                    cache = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).cache
            self.context.append(batch["input_ids"])
            self.positions.append(batch.get("position_ids"))
        else:
            cache = self.cache
        out = model(**batch, cache=cache, use_cache=True, **kwargs)
        if self.mode != "bptt":
            self.cache = out.cache.detach()  # gradients stop at the chunk boundary
            self.chunks += 1
        return out

    def snapshot(self):
        """What `forward` changes, to go back to it (a window cut short by a stop signal). The model's forward sets
        new attributes on the cache it is given (its `states` list), never changes the tensors: a shallow copy keeps
        the state as it is now."""
        return copy.copy(self.cache), self.chunks, list(self.context), list(self.positions)

    def restore(self, snap) -> None:
        self.cache, self.chunks, context, positions = snap
        self.context.clear()
        self.context.extend(context)
        self.positions.clear()
        self.positions.extend(positions)

    # Checkpointing: every process calls state_dict (Accelerate's save_state), the main process writes it.
    def state_dict(self) -> dict:
        gather = self.accelerator.gather
        states = None
        if self.cache is not None:  # (B, H, n) complex per layer -> all rows, as real pairs
            states = [gather(torch.view_as_real(s).contiguous()) for s in self.cache.states]
        context = [gather(ids.contiguous()) for ids in self.context]
        positions = [None if p is None else gather(p.contiguous()) for p in self.positions]
        return {"states": states, "chunks": self.chunks, "context": context, "positions": positions}

    def load_state_dict(self, sd: dict) -> None:
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
        self.positions.extend(None if p is None else mine(p) for p in sd.get("positions", [None] * len(sd["context"])))
