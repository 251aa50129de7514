"""The code saved beside a model's weights as two files: its configuration module and its modeling module.

`save_pretrained` copies the file that defines the model class and every file it imports relatively
(transformers' `custom_object_save`), and `from_pretrained(repo_id, trust_remote_code=True)` then prints "A new
version of the following files was downloaded" once per file: eight times for an S4 model. Transformers' own
remote-code models ship a configuration file and a modeling file. `bundle_saved_code` folds each module that
`auto_map` names, with the sibling modules it imports, into that one file and removes the folded copies: a reader
reviews two files and sees two notices. Hand-written because transformers has no option for it.

Only top-level `from .module import name[ as alias]` statements are folded. Anything else relative, and a name that
two folded modules both define (the later would silently replace the earlier), is refused with the names.
"""

import ast
import json
import os
from pathlib import Path

MAY_REPEAT = {"__all__"}  # each module's own export list; the entry module's, folded last, is the one kept


def bundle_saved_code(folder: str | os.PathLike) -> None:
    """Fold the code files in a saved model `folder` into one file per `auto_map` module (idempotent)."""
    folder = Path(folder)
    try:
        auto_map = json.loads((folder / "config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError):
        return
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    entries = sorted({r.rsplit(".", 1)[0] for r in refs if "--" not in r and "." in r})  # "repo--module.Class": code
    entries = [e for e in entries if (folder / f"{e}.py").is_file()]  # elsewhere, not ours to fold
    folded: set[str] = set()
    for entry in entries:
        source, used = fold(folder, entry, keep=set(entries))
        if used:
            tmp = folder / f".{entry}.py.{os.getpid()}.tmp"  # (two processes saving to one folder: no clash)
            tmp.write_text(source)
            os.replace(tmp, folder / f"{entry}.py")
        folded |= used
    for name in sorted(folded - set(entries)):
        (folder / f"{name}.py").unlink(missing_ok=True)


def fold(folder: Path, entry: str, keep: set[str]) -> tuple[str, set[str]]:
    """The source of `entry` with the sibling modules it imports (not those in `keep`) folded in, dependencies
    first; and the names of the folded modules (empty: nothing to fold, the source is returned as it is)."""
    trees: dict[str, ast.Module] = {}
    order: list[str] = []

    def visit(name: str, stack: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in stack:
            raise ValueError(f"{name}.py imports itself through {' -> '.join(stack)}")
        trees[name] = ast.parse((folder / f"{name}.py").read_text(), filename=f"{name}.py")
        for dep in relative_imports(trees[name], f"{name}.py"):
            if dep not in keep:
                visit(dep, stack + (name,))
        order.append(name)

    visit(entry, ())
    if order == [entry]:
        return (folder / f"{entry}.py").read_text(), set()
    check_names(order, trees)
    future, parts = [], []
    for name in order:
        lines = [[line] for line in (folder / f"{name}.py").read_text().splitlines()]  # line -> what replaces it
        for node in trees[name].body:
            if not isinstance(node, ast.ImportFrom) or not (node.level or node.module == "__future__"):
                continue
            if node.module == "__future__":
                future += [alias.name for alias in node.names]
                replacement = []
            elif node.module in keep:
                replacement = [ast.unparse(node)]  # another saved file: imported as before
            else:  # folded above: only its aliases need binding
                replacement = [f"{a.asname} = {a.name}" for a in node.names if a.asname and a.asname != a.name]
            lines[node.lineno - 1:node.end_lineno] = [replacement] + [[]] * (node.end_lineno - node.lineno)
        body = "\n".join(line for group in lines for line in group).strip("\n")
        parts.append(body if name == entry else f"# ---- {name}.py ----\n\n{body}")
    head = [f"# {entry}.py as saved with a model, the modules it imports folded in (s4accel.models.code_bundle):",
            f"# {', '.join(f'{n}.py' for n in order[:-1])}."]
    if future:
        head.append(f"from __future__ import {', '.join(sorted(set(future)))}")
    source = "\n".join(head) + "\n\n" + "\n\n\n".join(parts) + "\n"
    ast.parse(source, filename=f"{entry}.py")  # a folding mistake fails here, not in a user's from_pretrained
    return source, set(order[:-1])


def relative_imports(tree: ast.Module, filename: str) -> list[str]:
    """The sibling modules a module imports at its top level; any other relative import is refused."""
    top = {id(node) for node in tree.body}
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if id(node) not in top or node.level != 1 or not node.module or "." in node.module:
                raise ValueError(f"{filename}, line {node.lineno}: only top-level `from .module import name` "
                                 "can be folded into the saved code file")
            names.append(node.module)
    return names


def check_names(order: list[str], trees: dict[str, ast.Module]) -> None:
    """Refuse a top-level name bound to different things by two folded modules."""
    bound: dict[str, tuple[str, str]] = {}  # name -> (module, what binds it)
    for module in order:
        for node in trees[module].body:
            for name, what in bindings(node):
                if name in bound and bound[name][1] != what and name not in MAY_REPEAT:
                    raise ValueError(f"{module}.py and {bound[name][0]}.py both define `{name}`: they cannot be "
                                     "folded into one saved code file")
                bound[name] = (module, what)


def bindings(node: ast.stmt) -> list[tuple[str, str]]:
    """(name, what binds it) for the names a top-level statement binds; two imports of one object are alike."""
    if isinstance(node, ast.Import):
        return [((a.asname or a.name).split(".")[0], f"import {a.name}") for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # folded (its names are the sibling's own) or kept (a saved file's names)
            return [(a.asname, f"alias {node.module}.{a.name}") for a in node.names if a.asname]
        return [(a.asname or a.name, f"from {node.module} import {a.name}") for a in node.names]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [(node.name, f"def at {id(node)}")]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AnnAssign, ast.AugAssign)) else []
    return [(t.id, f"assign at {id(node)}") for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)]


class SavesFoldedCode:
    """Mixed into a PreTrainedModel: `save_pretrained` (and `push_to_hub`, and `save_pretrained(push_to_hub=True)`,
    whose upload goes through `_upload_modified_files`) leave the code folded as `bundle_saved_code` does."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", args[0] if args else True):
            bundle_saved_code(save_directory)

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        bundle_saved_code(working_dir)
        return super()._upload_modified_files(working_dir, *args, **kwargs)
