"""Writes the reference pages that come from the code: every recipe key (from the pydantic schema), every command
and option (from the Typer app, as `--help` prints them) and the Python API (from the package's docstrings).

    python docs/generate.py            # rewrite docs/reference/recipe.md, cli.md and python.md
    python docs/generate.py --check    # exit 1 when a page differs from the code (make docs; a test does the same)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

WIDTH = 100  # the help text's line width, fixed so that the page does not depend on the terminal


def cli_page() -> str:
    import typer

    from s4accel.cli import app, readable_help

    group = readable_help(typer.main.get_command(app))
    root = context(group, "s4accel", None)
    lines = ["# Command reference", "",
             "Generated from the command-line app (`python docs/generate.py`); do not edit by hand. Each section is "
             "what `s4accel COMMAND --help` prints. The recipe keys that `--set` takes are in "
             "[the recipe reference](recipe.md).", "", "```text", group.get_help(root),
             "```", ""]
    for name, command in group.commands.items():
        lines += [f"## s4accel {name}", "", "```text", command.get_help(context(command, name, root)), "```", ""]
    return "\n".join(lines)


def python_page() -> str:
    """The public names of `import s4accel`: each one's signature and docstring, and the methods of the classes a
    user subclasses (Task, Callback)."""
    import inspect

    import s4accel

    lines = ["# Python API", "",
             "Generated from the package (`python docs/generate.py`); do not edit by hand. Every name below is an "
             "attribute of `s4accel` (`import s4accel`), imported when first used.", ""]
    for name in s4accel.__all__:
        if name == "__version__":
            continue
        obj = getattr(s4accel, name)
        lines += [f"## `s4accel.{name}`", ""]
        if callable(obj):
            lines += ["```python", f"{name}{signature(obj)}", "```", ""]
        doc = inspect.getdoc(obj) if inspect.isclass(obj) or callable(obj) else None
        inherited = inspect.isclass(obj) and doc == inspect.getdoc(obj.__mro__[1])
        if doc and not inherited and not doc.startswith(f"{name}("):  # not a dataclass's generated one
            lines += [doc, ""]
        if name == "MODEL_SIZES":
            lines += ["| name | family | fields |", "|---|---|---|"]
            lines += [f"| `{size}` | {fields['family']} | " + ", ".join(f"{k} {v}" for k, v in fields.items()
                                                                  if k != "family") + " |"
                      for size, fields in obj.items()]
            lines.append("")
        if name in ("Task", "Callback"):
            for method, member in vars(obj).items():
                if method.startswith("_") or not callable(member):
                    continue
                lines += [f"### `{name}.{method}`", "", "```python", f"{method}{signature(member)}", "```", ""]
                if member.__doc__:
                    lines += [inspect.cleandoc(member.__doc__), ""]
    return "\n".join(lines)


def signature(obj) -> str:
    import inspect
    import re

    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # a default's address changes from run to run


def context(command, name, parent):
    ctx_class = type(command).context_class
    return ctx_class(command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)


def pages() -> dict[Path, str]:
    from s4accel.tools.recipe_reference import page

    return {DOCS / "reference" / "recipe.md": page(), DOCS / "reference" / "cli.md": cli_page(),
            DOCS / "reference" / "python.md": python_page()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    stale = []
    for path, text in pages().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.relative_to(DOCS.parent))
        else:
            path.write_text(text)
    if stale:
        print("out of date with the code (run python docs/generate.py): " + ", ".join(map(str, stale)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
