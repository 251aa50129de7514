"""Importing what a recipe names by path: `package.module:attr` or `path/to/file.py:attr` (tasks, state hooks),
with one-line errors naming the recipe key."""

from __future__ import annotations

import importlib
import importlib.util
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
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    name = f"s4accel_task_{path.stem}"
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
