"""A seeded shuffle buffer of blocks whose contents are part of its position, so a stream restored from a checkpoint
hands out exactly the blocks an uninterrupted one would.

`datasets`' own buffer (`IterableDataset.shuffle(buffer_size=...)`) is not restored by `load_state_dict`: it is
refilled from the restored source position, so the examples it held when the state was taken are lost and others
repeated. This one holds `size` blocks, hands out one at random per call and puts the source's next block in its
place (every block is handed out once, later or sooner); its state is the blocks it holds and its generator.
"""

from __future__ import annotations

import copy

import numpy as np
import torch


class ShuffleBuffer:
    """`take(source)` -> the next block of `source` (anything with `next_block()` and `epoch`) in shuffled order."""

    def __init__(self, size: int, seed: int | list[int], dtype: np.dtype):
        self.size, self.dtype = size, dtype
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))
        self.blocks: np.ndarray | None = None  # (held, seq_len), filled on the first call

    def take(self, source) -> np.ndarray:
        if self.blocks is None:
            self.blocks = self._fill(source)
        i = int(self.rng.integers(len(self.blocks)))
        block = self.blocks[i].copy()
        self.blocks[i] = source.next_block()
        return block

    def _fill(self, source) -> np.ndarray:
        """`size` blocks, or one pass over a source that holds fewer (and the next pass's first block): more would
        hold copies of the same blocks from several passes."""
        start, rows = source.epoch, []
        while len(rows) < self.size:
            rows.append(source.next_block())
            if source.epoch != start:
                break
        return np.stack(rows)

    def state_dict(self) -> dict:
        return {"blocks": None if self.blocks is None else torch.from_numpy(self.blocks.astype(np.int32)),
                "rng": copy.deepcopy(self.rng.bit_generator.state)}

    def load_state_dict(self, state: dict) -> None:
        self.blocks = None if state["blocks"] is None else state["blocks"].numpy().astype(self.dtype)
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])
