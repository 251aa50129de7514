"""How the `s4accel` command line reads: its help as a user reads it, a bare `--resume` and `--fast-dev-run`."""

from __future__ import annotations

from pathlib import Path


def readable_help(group):
    """The help as a user reads it: each command's whole first sentence in the command list (click cut it at 45
    characters), and placeholders in capitals, as in `s4accel eval [OPTIONS] MODEL [RECIPE]` and `--data PATH`
    (typer writes `{model}` and `<path>`)."""
    for command in [group, *group.commands.values()]:
        if command is not group and command.help and not command.short_help:
            first = " ".join(command.help.split("\n\n")[0].split())
            command.short_help = first.split(". ")[0].rstrip(".") + "."
        usage = command.collect_usage_pieces  # typer braces a required argument: {MODEL}
        command.collect_usage_pieces = lambda ctx, usage=usage: [p.replace("{", "").replace("}", "")
                                                                 for p in usage(ctx)]
        for param in command.params:
            if param.metavar is not None or getattr(param, "is_flag", False) or not hasattr(param, "display_type"):
                continue  # set by hand, a flag, or an older typer (click's own placeholders: PATH, INTEGER)
            if param.param_type_name == "argument":
                param.metavar = param.name.upper()
                param.display_type_rich = lambda ctx: None  # its help says what it is: no `<path>` beside it
                continue
            shown = param.display_type(None).strip("<>")  # typer's label: int, int range, path, str, a|b, ...
            if "|" not in shown:  # choices stay listed
                param.metavar = {"int": "INTEGER", "int range": "INTEGER", "float range": "FLOAT",
                                 "str": "TEXT"}.get(shown, shown.upper())
    return group


def bare_resume_to_latest(argv: list[str]) -> list[str]:
    """`--resume` takes an optional value, which click options cannot: a bare `--resume` (last, or followed by an
    option or by the recipe, a .yaml file or a run directory) becomes `--resume=latest`."""
    out = list(argv)
    for i, arg in enumerate(out):
        nxt = out[i + 1] if i + 1 < len(out) else None
        if arg == "--resume" and (nxt is None or nxt.startswith("-") or nxt.endswith((".yaml", ".yml"))
                                  or (Path(nxt) / "recipe.yaml").is_file()):
            out[i] = "--resume=latest"
    return out


def bare_fast_dev_run(argv: list[str]) -> list[str]:
    """A bare `--fast-dev-run` (not followed by a number) is `--fast-dev-run=1`, as Lightning's `fast_dev_run=True`
    is one batch."""
    out = list(argv)
    for i, arg in enumerate(out):
        nxt = out[i + 1] if i + 1 < len(out) else None
        if arg == "--fast-dev-run" and not (nxt is not None and nxt.lstrip("-").isdigit()):
            out[i] = "--fast-dev-run=1"
    return out
