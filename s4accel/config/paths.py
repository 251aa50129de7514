"""Relative paths in a recipe: a path written in a recipe file means the file next to the recipe (so
`s4accel train examples/diabetes.yaml` works from any directory); a path given with `--set` means one relative to the
current directory, as a shell user expects. Each is made absolute where it is found, so the `recipe.yaml` a run keeps
names the same files wherever the run is resumed from. A value found in neither place is left as written: it may be
a Hub id or a builder name, and the data or model code says what is missing.

The other way, for a recipe published with a model (`portable_recipe`): the machine's absolute paths become names
another user can place next to the recipe."""

from __future__ import annotations

import copy
import glob
import os
from pathlib import Path, PurePosixPath
from typing import Callable, NamedTuple

from .data_sections import TEXT_SOURCES

FILE_KEYS = ("files", "val_files", "data_files", "path")
"""Keys of `data` (and of each `data.mixture` item and `data.eval_sets` entry) naming files, globs or a folder."""
ARRAY_ONLY = ("task", "normalize", "ucr_name")
"""Keys of `data` that only number sequences read (classification or regression, standardising, a UCR set)."""
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

    eval_sets = _get(raw, ("data", "eval_sets"))
    sections = [("data",), *(("data", "mixture", i) for i in range(len(_get(raw, ("data", "mixture")) or []))),
                *(("data", "eval_sets", name) for name in (eval_sets if isinstance(eval_sets, dict) else ()))]
    for section in sections:
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


MACHINE_ONLY = (("run", "out_dir"), ("data", "cache_dir"))
"""Where the training machine kept the run and its caches: of no use elsewhere, published as null (the defaults)."""
TEXT_KEYS = (("sample", "prompts"),)
"""Values that are text, never paths, whatever they start with."""


class Renamed(NamedTuple):
    key: str
    """Where in the recipe, list indices left out: `data.files`."""
    path: str
    """The absolute path on the training machine."""
    name: str
    """What the published recipe says instead."""


def portable_recipe(raw: dict) -> tuple[dict, list[Renamed]]:
    """A copy of a run's resolved recipe that names no path of the training machine, for a model card and the
    `recipe.yaml` beside a published model; with what it renamed.

    Every absolute path (a data file or glob, a tokenizer or model folder, a `file.py:Class`, anywhere in the recipe)
    becomes its name: a file's or folder's own name, a glob's pattern with the folder holding it (`corpus/*.parquet`),
    with as many parent folders as it takes to tell two apart. A recipe reads a relative path next to itself, so the
    published recipe runs wherever a user puts their own files under those names beside it: the data was the training
    machine's own, and the folders above it say nothing but where that machine keeps things. Hub ids, builder names
    and other relative values are kept; `run.out_dir` and `data.cache_dir` become null."""
    out = copy.deepcopy(raw)
    for key in MACHINE_ONLY:
        parent = _get(out, key[:-1])
        if isinstance(parent, dict) and parent.get(key[-1]) is not None:
            parent[key[-1]] = None
    found: dict[tuple, tuple[str, str]] = {}  # key -> (absolute path, ":attr" after a file.py)

    def walk(node, key: tuple):
        if key in TEXT_KEYS:
            return
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*key, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*key, i))
        elif isinstance(node, str):
            file, attr = _split_import(node)
            if os.path.isabs(os.path.expanduser(file)):
                found[key] = (os.path.expanduser(file), attr)

    data = out.get("data")
    if isinstance(data, dict) and data.get("source", "shakespeare") in TEXT_SOURCES:
        for key in ARRAY_ONLY:  # a reader would look for what they change in a text model: they change nothing
            data.pop(key, None)
    walk(out, ())
    names = _short_names({path for path, _ in found.values()})
    renamed = []
    for key, (path, attr) in found.items():
        parent = _get(out, key[:-1])
        parent[key[-1]] = names[path] + attr
        renamed.append(Renamed(".".join(str(k) for k in key if not isinstance(k, int)), path, names[path] + attr))
    return out, renamed


def _split_import(value: str) -> tuple[str, str]:
    """`path/file.py:Class` -> (`path/file.py`, `:Class`); any other value -> (value, "")."""
    file, sep, attr = value.rpartition(":")
    return (file, sep + attr) if sep and file.endswith(".py") else (value, "")


def _short_names(paths: set[str]) -> dict[str, str]:
    """Each absolute path's name: its last part (a glob: from the folder holding its pattern), with more parent
    folders for paths that would otherwise share a name."""
    parts = {p: PurePosixPath(p).parts[1:] for p in paths}
    start = {}
    for p, ps in parts.items():
        magic = next((i for i, part in enumerate(ps) if glob.has_magic(part)), None)
        start[p] = max(0, len(ps) - 1 if magic is None else magic - 1)
    while True:
        names = {p: "/".join(parts[p][start[p]:]) or "." for p in paths}
        clashing = [p for p in paths if start[p] > 0 and sum(n == names[p] for n in names.values()) > 1]
        if not clashing:
            return names
        for p in clashing:
            start[p] -= 1
