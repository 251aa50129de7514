"""`datasets` shows a progress bar for every map, filter and file it reads. On small data they flash past as noise
(two bars for the quick-start's 38 plays), so they show only for data big enough to take a while."""

from __future__ import annotations

import contextlib

import datasets

BIG = 10_000
"""Rows from which a map or filter shows its bar: below it our tokenising and packing take well under a second."""


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
