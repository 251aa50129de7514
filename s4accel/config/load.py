"""Reading a recipe: YAML (duplicate keys and alias bombs refused) + `--set section.key=value` overrides -> a validated
`Recipe`. Every problem is a `RecipeError`, one line each, naming the file, the key path and what is allowed (with a
did-you-mean for a near miss)."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import RecipeError, did_you_mean as _did_you_mean
from .paths import anchor_paths
from .schema import Recipe
from .trainer_names import trainer_hint

MAX_RECIPE_VALUES = 100_000
"""A recipe holds a few hundred values; YAML aliases can make a few lines stand for billions (an "alias bomb"), which
validate quickly but take minutes and gigabytes to write back out."""


class _RecipeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (PyYAML keeps the last one silently, so a second
    `train:` section would replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.2's booleans: true and false only. PyYAML follows YAML 1.1, where yes/no/on/off are booleans too, so the
# documented `mixed_precision: no` arrived as False and a run named `no` as a flag. A flag still takes those words:
# pydantic reads "yes"/"no"/"on"/"off" as booleans where a field is one.
_BOOL = "tag:yaml.org,2002:bool"
_RecipeLoader.yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
                                         for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_RecipeLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


MAX_DEPTH = 50
"""A recipe nests a few levels (a mixture's source in a list in `data`); thousands of lists inside each other only
exhaust Python's recursion, in the YAML reader or in validation."""


def _count_values(tree, limit: int) -> int:
    """Values in a loaded YAML tree, counting every use of an alias, stopping past `limit`; a tree nested deeper than
    `MAX_DEPTH` counts as past it."""
    count, stack = 0, [(tree, 0)]
    while stack and count <= limit:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            return limit + 1
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return count


def _read_yaml(text: str):
    """YAML with the recipe loader; a document nested too deeply for the reader is one line, not a RecursionError."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)
    except RecursionError:
        raise RecipeError(f"lists or mappings nested too deeply to read (a recipe nests at most {MAX_DEPTH} levels)") \
            from None


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `section.key=value` overrides (values parsed as YAML), validate.

    `path` may be a run directory: its resolved `recipe.yaml` is read and the run stays in that directory, wherever
    the command runs from and whatever `--set` items started it (so `s4accel train RUN_DIR --resume` continues it).

    Raises `RecipeError` naming the file, the key path and what is allowed.
    """
    path = Path(path)
    run_dir = path if path.is_dir() and (path / "recipe.yaml").is_file() else None
    try:
        raw = _read_yaml((path / "recipe.yaml" if run_dir else path).read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except IsADirectoryError:
        raise RecipeError(f"{path}: is a directory without a recipe.yaml (neither a recipe file nor a run "
                          f"directory)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read recipe ({e})") from None
    except RecipeError as e:
        raise RecipeError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None or raw == {}:
        raise RecipeError(f"{path}: the recipe is empty (a recipe names at least its data and model; see recipes/)")
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections (run, model, data, ...)")
    if _count_values(raw, MAX_RECIPE_VALUES) > MAX_RECIPE_VALUES:
        raise RecipeError(f"{path}: the recipe expands to more than {MAX_RECIPE_VALUES:,} values or nests deeper "
                          f"than {MAX_DEPTH} levels (YAML aliases repeating aliases?); refusing to load it")
    if run_dir is not None and isinstance(raw.get("run"), dict):
        # The run continues where it is; `overwrite` belonged to the command that started it, not to a continuation.
        raw["run"].update(out_dir=str(run_dir), overwrite=False)
    for item in overrides:
        _apply_override(raw, item)
    if overrides and _count_values(raw, MAX_RECIPE_VALUES) > MAX_RECIPE_VALUES:  # --set values are YAML too
        raise RecipeError(f"--set: the recipe with these values expands to more than {MAX_RECIPE_VALUES:,} values "
                          f"or nests deeper than {MAX_DEPTH} levels (YAML aliases repeating aliases?); refusing to "
                          f"load it")
    # The recipe's own relative paths mean files next to it; --set ones, files relative to where the command runs.
    # A run directory's recipe.yaml holds them made absolute already.
    overridden = [tuple(item.partition("=")[0].strip().split(".")) for item in overrides]
    anchor_paths(raw, lambda key: Path.cwd() if any(_under(key, o) for o in overridden) else
                 None if run_dir else path.parent)
    return validate_recipe(raw, source=str(path / "recipe.yaml" if run_dir else path))


def _under(key: tuple, prefix: tuple) -> bool:
    """Whether the recipe value at `key` (its list indices dropped) is at or under the `--set` key `prefix`."""
    names = tuple(str(part) for part in key if not isinstance(part, int))
    return names[:len(prefix)] == prefix


def validate_recipe(raw: dict, source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError("\n".join(f"{source}: {_format_error(err)}" for err in e.errors())) from None


def _short(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to its first `limit` characters: an error line quotes a value, it does not reproduce it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise RecipeError(f"--set {_short(item)}: expected section.key=value, e.g. optim.lr=1e-3")
    try:
        parsed = _read_yaml(value)
    except RecipeError as e:
        raise RecipeError(f"--set {_short(item)}: {e}") from None
    except yaml.YAMLError:
        parsed = value  # not YAML: keep the raw string, validation will say if a string does not fit
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"--set {_short(item)}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = parsed


def _section_model(annotation) -> type[BaseModel] | None:
    """The section class in an annotation `X`, `X | None` or `list[X]`; None for anything else."""
    return next((a for a in (annotation, *typing.get_args(annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)), None)


def _fields_at(loc: tuple) -> list[str] | None:
    """Field names of the section a validation error's location points into (None past a free-form dict)."""
    model: Any = Recipe
    keyed = False  # the part just read was a `dict[str, Section]` field: the next part is a key of it
    for part in loc:
        if isinstance(part, int) or keyed:
            keyed = False
            continue  # an item of a list of sections (callbacks), a key of a dict of them (data.eval_sets)
        annotation = getattr(model.model_fields.get(part), "annotation", None)
        model = _section_model(annotation)
        if model is None:
            return None
        keyed = typing.get_origin(annotation) is dict
    return None if keyed else list(model.model_fields)


def _format_error(err: dict) -> str:
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        if hint := trainer_hint(loc[-1]):  # a Trainer or Lightning habit: its place, not a look-alike key
            return f"{path}: unknown key; {hint}"
        allowed = _fields_at(loc[:-1]) or []
        return f"{path}: unknown key{_did_you_mean(loc[-1], allowed)}; allowed: {', '.join(allowed)}"
    msg = err["msg"].removeprefix("Value error, ")
    if not loc or msg.startswith((f"{path}.", f"{path}:")):  # a check across keys: its message names them
        return msg
    if err["type"] == "missing":
        msg = "required key is missing"
    elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {_short(err['input'])})"
    return f"{path}: {msg}"
