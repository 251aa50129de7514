"""`datasets` shows a progress bar for every map, filter and file it reads. On small data they flash past as noise
(two bars for the quick-start's 38 plays), so they show only for data big enough to take a while. Tokenising shows a
bar of its own, in bytes with MB/s, decided by the size of the text: a corpus of a few large documents takes as long
as one of many small ones, and `datasets`' bar counts documents (one batch of 1,000 of them: nothing, then done)."""

from __future__ import annotations

import contextlib

import datasets
import pyarrow.compute as pc
from tqdm.auto import tqdm

BIG = 10_000
"""Rows from which a map or filter shows its bar: below it our tokenising and packing take well under a second."""

BIG_BYTES = 10 * 2**20
"""Bytes of text from which tokenising shows its bar, however few documents hold them: a subword tokenizer runs at
about 2.5 MB/s here, so 10 MB take seconds (the byte tokenizer, about 70 times faster, a fraction of one)."""


@contextlib.contextmanager
def bars_for(n_rows: int | None):
    """`datasets`' bars inside the block: on (if they are on at all) for `n_rows` of at least BIG or unknown (a
    stream, a download), off for less."""
    was_on = datasets.is_progress_bar_enabled()
    if n_rows is not None and n_rows < BIG:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def text_bytes(column) -> int:
    """UTF-8 bytes of an Arrow string column, from its offsets (no Python string per document)."""
    return int(pc.sum(pc.binary_length(column)).as_py() or 0) if len(column) else 0


class _ByteBar:
    """The bar of the tokenising `datasets.map` running in this process: opened when the map's function first runs
    (a map answered from the cache runs nothing and shows nothing), advanced by each batch's bytes."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.bar = total, desc, None

    def batch_started(self) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.total, desc=self.desc, unit="B", unit_scale=True, dynamic_ncols=True)

    def batch_done(self, n_bytes: int) -> None:
        self.bar.update(n_bytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_active: _ByteBar | None = None
"""Held here, not by the mapped function: `datasets` fingerprints the function (and what it holds) to find its cache,
and a bar's changing state would miss the cache every time."""


@contextlib.contextmanager
def tokenizing(docs, desc: str, num_proc: int | None = None, column: str = "text"):
    """Progress of tokenising `docs[column]` with `datasets.map` inside the block, whose function wraps each batch in
    `counted(texts)`: a bar in bytes with MB/s for text of BIG_BYTES or more or for BIG rows or more, whatever the
    document count, if `datasets`' bars are on (`log.progress_bar`). With `num_proc` workers, which cannot draw this
    process's bar, `datasets`' own bar (by documents) shows instead."""
    global _active
    total = text_bytes(docs.data.column(column))
    big = len(docs) >= BIG or total >= BIG_BYTES
    if num_proc is not None and num_proc > 1:
        with bars_for(None if big else 0):
            yield
        return
    show = big and datasets.is_progress_bar_enabled()
    _active = _ByteBar(total, desc) if show else None
    try:
        with bars_for(0):  # this bar instead of datasets' own
            yield
    finally:
        if _active is not None:
            _active.close()
        _active = None


@contextlib.contextmanager
def counted(texts):
    """One batch of the tokenising map: its bytes added to the bar when it is done (nothing without a bar)."""
    bar = _active
    if bar is not None:
        bar.batch_started()
    yield
    if bar is not None:
        bar.batch_done(text_bytes(texts))
