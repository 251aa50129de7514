"""The package's architecture holds: imports point one way (cli and tools -> training -> data, models, config), the
model files stand alone, no module imports another that imports it back, the loop fits on a screen."""

import ast
import pathlib

from helpers import REPO

PACKAGE = REPO / "s4accel"
LAYER = {"config": 0, "models": 0, "data": 1, "training": 2, "tools": 3}
SHARED = ("s4accel.errors", "s4accel._autoregister")  # the error classes and the Auto-class registration


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports() -> dict[str, set[str]]:
    """Every s4accel module each module imports, at the top or inside a function."""
    mods = modules()
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                for name in [target, *(f"{target}.{a.name}" for a in node.names)]:
                    if name in mods and name != m:
                        edges[m].add(name)
            elif isinstance(node, ast.Import):
                edges[m] |= {a.name for a in node.names if a.name in mods and a.name != m}
    return edges


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYER) else None


def test_imports_point_one_way_and_the_models_stand_alone():
    wrong = []
    for m, targets in imports().items():
        for t in targets:
            lm, lt = layer(m), layer(t)
            if lm == "models" and lt != "models":
                wrong.append((m, t))  # the model files are copied into Hub repos: only torch, transformers, siblings
            elif lm is not None and lt is None and t not in SHARED:
                wrong.append((m, t))  # a layer reaching up to the CLI or the package's public face
            elif lm is not None and lt is not None and LAYER[lt] > LAYER[lm]:
                wrong.append((m, t))
    assert not wrong, wrong


def test_no_import_cycle():
    edges = imports()
    seen, on_path, cycles = set(), [], []

    def visit(m):
        if m in on_path:
            cycles.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for t in sorted(edges[m]):
            if not (t == "s4accel" or m.startswith(t + ".") or t.startswith(m + ".")):  # a package and its members
                visit(t)
        on_path.pop()

    for m in sorted(edges):
        visit(m)
    assert not cycles, cycles[:3]


def test_the_loop_fits_on_a_screen_and_no_module_is_a_god_file():
    tree = ast.parse((PACKAGE / "training" / "loop.py").read_text())
    length = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert length["train"] <= 30 and length["_train"] <= 75, length  # the checks, then the run read in one screen
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
             if "models" not in p.parts}  # the modeling files follow transformers' one-file-per-model layout
    assert max(sizes.values()) <= 420, sizes


def calls_and_writes():
    """(module, what) for each call of a task's building methods and each assignment to an attribute of a `task` or
    `recipe` variable (or `self.recipe`), anywhere in the package."""
    building = {"build_data", "dataloaders", "build_optimizers", "build_model", "setup"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        module = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in building \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "task":
                found.append((module, f"task.{node.func.attr}()"))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "TaskContext":
                found.append((module, "TaskContext()"))
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for part in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(part, ast.Attribute) and ast.unparse(part.value) in ("task", "recipe",
                                                                                        "self.recipe"):
                        found.append((module, f"{ast.unparse(part)} ="))
    return found


def test_one_place_builds_a_run_and_nothing_writes_into_the_task_or_the_recipe():
    """train, eval, lr-find, find-batch-size and show build through training/setup.py; the loop reads what a task
    returns (its loaders, a window's statistics) instead of attributes it sets, and the recipe is never written."""
    found = calls_and_writes()
    outside = [(m, what) for m, what in found if m != "training/setup.py"]
    assert not outside, outside


def test_the_cli_turns_user_errors_into_one_line_in_one_place():
    """Every command is registered through cli.command, which prints an S4AccelError as `error: ...` and exits with
    its code; no command repeats that handling."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    handlers = [n for n in ast.walk(tree)
                if isinstance(n, ast.ExceptHandler) and ast.unparse(n.type) == "S4AccelError"]
    assert len(handlers) == 1
    commands = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.decorator_list]
    assert commands and all(ast.unparse(d.func) == "command" for n in commands for d in n.decorator_list), \
        [(n.name, [ast.unparse(d) for d in n.decorator_list]) for n in commands]


TRAINING = PACKAGE / "training"
CONCERNS = ("runs", "devices", "observe")  # the folders of training/, each a concern the loop uses


def test_training_is_split_by_concern_and_each_folder_says_what_it_holds():
    """training/ keeps the loop and its task at the top; a run's life on disk, devices and precision, and what a
    run shows live in their folders, whose docstrings list exactly the files they hold."""
    top = sorted(p.stem for p in TRAINING.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 16, top
    assert sorted(p.name for p in TRAINING.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(CONCERNS)
    for concern in CONCERNS:
        folder = TRAINING / concern
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        listed = {word.removesuffix(",") for line in doc.splitlines() for word in line.split()
                  if word.removesuffix(",").endswith(".py")}
        assert listed == {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}, concern
    training_doc = ast.get_docstring(ast.parse((TRAINING / "__init__.py").read_text()))
    assert all(f"{concern}/" in training_doc for concern in CONCERNS)


def test_the_concerns_never_import_the_loop():
    """The loop uses runs/, devices/ and observe/; they never reach back into the loop, its step, its setup or its
    evaluation (they may use the task API and the callbacks the loop hands them)."""
    loop = {f"s4accel.training.{m}" for m in ("loop", "step", "setup", "evaluate")}
    wrong = [(m, t) for m, targets in imports().items() for t in targets
             if any(m.startswith(f"s4accel.training.{c}") for c in CONCERNS) and t in loop]
    assert not wrong, wrong


def test_the_architecture_page_names_every_module():
    """docs/explanation/architecture.md is the map a newcomer reads: a module it does not name is one they cannot
    find from it."""
    page = (REPO / "docs" / "explanation" / "architecture.md").read_text()
    missing = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" and p.name not in page]
    assert not missing, missing
    assert all(f"s4accel/training/{concern}/" in page for concern in CONCERNS)
