"""The recipe reference page, generated from the schema: every key with its type, default and docstring.

    python docs/generate.py     # writes it to docs/reference/recipe.md, with the command reference

The docstrings are the ones written under each field in `s4accel/config/` (read from the source, as pydantic keeps
them only from 2.7 on); a test fails when the page and the schema drift apart.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
import types
import typing
from functools import cache

from pydantic import BaseModel

from ..config import Recipe

INTRO = """# Recipe reference

Generated from the schema (`python docs/generate.py`); do not edit by hand. A recipe is YAML with
the sections below; any key can also be set on the command line with `--set section.key=value`. A key a recipe
leaves out takes its default; `s4accel show RECIPE` prints a recipe with every default filled in. A mistake (an
unknown key, a wrong type, a value out of range) is one line naming the key, before anything runs.
"""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of `cls` and its bases, from their source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def type_name(annotation) -> str:
    """`int | None` -> `int or null`, `Literal["a", "b"]` -> `"a" or "b"`, `list[str]` -> `list of str`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(type_name(a) for a in args))
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("Path", "path")


def default_text(field) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    try:
        return json.dumps(value, default=str)
    except TypeError:
        return str(value)


def is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def section_of(annotation) -> type | None:
    """The section class of `Section` or `Section | None`, else None."""
    if is_section(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) == 1 and is_section(inner[0]):
            return inner[0]
    return None


def rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every field of a section, nested sections flattened as `prefix.key.sub`."""
    out = []
    docs = field_docs(cls)
    for name, field in cls.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        annotation = field.annotation
        if (inner := section_of(annotation)) is not None:
            kind = "section" if inner is annotation else "section or null"
            out.append((key, kind, default_text(field) if inner is not annotation else "", docs.get(name, "")))
            out += rows(inner, key)
            continue
        items = typing.get_args(annotation)
        if typing.get_origin(annotation) is dict and (ranged := next(
                (a for a in (items[1], *typing.get_args(items[1])) if is_section(a)), None)):  # values: a section,
            # or a section among others
            out.append((key, type_name(annotation), default_text(field), docs.get(name, "")))
            out += rows(ranged, f"{key}.<key>")
            continue
        if typing.get_origin(annotation) is list and items and is_section(items[0]):
            out.append((key, f"list of {key} items", "[]", docs.get(name, "")))
            out += rows(items[0], f"{key}[]")
            continue
        out.append((key, type_name(annotation), default_text(field), docs.get(name, "")))
    return out


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def page() -> str:
    lines = [INTRO]
    top = field_docs(Recipe)
    for name, field in Recipe.model_fields.items():
        lines += [f"## `{name}`", "", top.get(name, ""), "", "| key | type | default | what it does |",
                  "|---|---|---|---|"]
        annotation = field.annotation
        inner = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else \
            section_of(annotation)  # a section, or a section or null (`sweep`)
        prefix = f"{name}[]" if typing.get_origin(annotation) is list else name
        for key, kind, default, doc in rows(inner, prefix):
            shown = default if default in ("", "(required)") else f"`{cell(default)}`"
            lines.append(f"| `{key}` | {cell(kind)} | {shown} | {cell(doc)} |")
        lines.append("")
    return "\n".join(lines)

