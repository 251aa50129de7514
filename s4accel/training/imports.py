"""Importing what a recipe names by path: `package.module:attr` or `path/to/file.py:attr` (tasks, state hooks),
with one-line errors naming the recipe key."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path

from ..errors import RecipeError


def import_object(target: str, key: str):
    """The object `target` names; an error (`ImportError`, a missing file or attribute, a syntax error) is a
    `RecipeError` naming `key`."""
    module_name, _, attr = target.partition(":")
    try:
        obj = _module_from_file(Path(module_name)) if module_name.endswith(".py") else \
            importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as e:
        raise RecipeError(f"{key}: cannot import {target!r} ({type(e).__name__}: {e})") from None
    return obj


def _module_from_file(path: Path):
    """The module of `path`, imported once per file and contents: the module's name holds a digest of the file's
    resolved path and bytes, so two projects' `hooks.py` in one Python session (a notebook, a sweep of
    `s4accel.train` calls) are two modules, and a file edited between two runs is imported again, while the targets
    of one run that name the same file (its task and a callback) share one module."""
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode() + b"\0" + resolved.read_bytes()).hexdigest()[:16]
    name = f"s4accel_task_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
