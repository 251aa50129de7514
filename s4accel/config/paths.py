"""Relative paths in a recipe: a path written in a recipe file means the file next to the recipe (so
`s4accel train examples/diabetes.yaml` works from any directory); a path given with `--set` means one relative to the
current directory, as a shell user expects. Each is made absolute where it is found, so the `recipe.yaml` a run keeps
names the same files wherever the run is resumed from. A value found in neither place is left as written: it may be
a Hub id or a builder name, and the data or model code says what is missing."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Callable

FILE_KEYS = ("files", "val_files", "data_files", "path")
"""Keys of `data` (and of each `data.mixture` item) naming files, globs or a folder."""
IMPORT_KEYS = (("task", "target"), ("task", "metrics"), ("model", "state_hook"), ("scheduler", "kwargs", "target"))
"""`path/file.py:attr` values (or lists of them) outside `data` (callbacks' targets too)."""


def anchor_paths(raw: dict, base: Callable[[tuple], Path | None]) -> None:
    """Rewrite, in place, each relative path of a raw recipe dict that exists under `base(key)` (None: leave it) to
    an absolute one. `key` is the value's place in the recipe, e.g. ("data", "files")."""
    def fix(value, key: tuple):
        folder = base(key)
        if folder is None:
            return value
        if isinstance(value, list):
            return [fix(v, key) for v in value]
        if isinstance(value, dict):  # data_files: {train: ..., validation: ...}
            return {k: fix(v, key) for k, v in value.items()}
        if isinstance(value, str):
            return _absolute(value, folder)
        return value

    def fix_import(value, key: tuple):
        folder = base(key)
        if isinstance(value, list):  # task.metrics
            return [fix_import(v, key) for v in value]
        if not isinstance(value, str) or folder is None or ".py:" not in value:
            return value
        file, _, attr = value.rpartition(":")
        return f"{_absolute(file, folder)}:{attr}"

    for section in [("data",)] + [("data", "mixture", i) for i in range(len(_get(raw, ("data", "mixture")) or []))]:
        node = _get(raw, section)
        if isinstance(node, dict):
            for k in FILE_KEYS:
                if k in node:
                    node[k] = fix(node[k], (*section, k))
    data = _get(raw, ("data",))
    if isinstance(data, dict) and isinstance(data.get("tokenizer"), str) and data["tokenizer"] not in ("byte", "bpe"):
        data["tokenizer"] = fix(data["tokenizer"], ("data", "tokenizer"))
    model = _get(raw, ("model",))
    if isinstance(model, dict) and isinstance(model.get("pretrained"), str):
        model["pretrained"] = fix(model["pretrained"], ("model", "pretrained"))
    for key in IMPORT_KEYS:
        parent = _get(raw, key[:-1])
        if isinstance(parent, dict) and key[-1] in parent:
            parent[key[-1]] = fix_import(parent[key[-1]], key)
    callbacks = raw.get("callbacks")
    if isinstance(callbacks, list):
        for i, cb in enumerate(callbacks):
            if isinstance(cb, dict) and "target" in cb:
                cb["target"] = fix_import(cb["target"], ("callbacks", i, "target"))


def _absolute(value: str, folder: Path) -> str:
    if not value:
        return value
    expanded = os.path.expanduser(value)  # `~/corpus` is the home folder's, as a shell reads it
    if os.path.isabs(expanded):
        return expanded
    candidate = str(folder / value)
    found = glob.glob(candidate) if glob.has_magic(candidate) else Path(candidate).exists()
    return os.path.abspath(candidate) if found else value


def _get(raw, key: tuple):
    node = raw
    for part in key:
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and part < len(node) else None
        else:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None
    return node
