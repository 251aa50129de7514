"""The run directory's life: checked before anything is built, written only once every check has passed.

A new run (or an overwrite) builds in `run_dir/.staging` (the BPE tokenizer a task trains, for instance); `commit()`
moves it into place once data, model, optimizers and loaders are built. Until then nothing of an earlier run is
touched, and a failure removes the staging folder and every folder it had to create, so a recipe that fails its
checks leaves no trace. An overwritten run's outputs are moved into `run_dir/.replaced-<time>` by `commit()` and
deleted by `drop_replaced()` once the new run has started. A `--resume` that finds no usable checkpoint starts fresh
and keeps the earlier attempt's outputs in `run_dir/earlier-<time>` (never deleted), unless they include a finished
model, which it refuses to replace without `run.overwrite`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import time
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import broadcast_object_list

from ...errors import RunDirError
from ..observe.console import RUN_LOG

RUN_OUTPUTS = ("final", "final_ema", "best", "checkpoints", "metrics.jsonl", "tensorboard", "samples.txt", "tokenizer",
               "train.log", "profile")
"""What a run writes; a directory holding any of them holds a run."""


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_dir(new: Path, target: Path) -> None:
    """Rename the folder `new` to `target`. A folder already at `target` is moved aside first and deleted once `new`
    is in place: at every moment `target` is whole, the old one or the new one (after a crash in between, the old one
    waits as `.<name>.old`, removed by the next replacement)."""
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


class RunDir:
    """One run's directory. `resuming`: a checkpoint of it will be loaded; `resume_requested`: what asked for a resume
    (`--resume` or `train.resume: auto`, maybe finding nothing to resume), None when nothing did; `overwrite`:
    `run.overwrite`. Methods that write act on the main process."""

    def __init__(self, path: Path, is_main: bool, resuming: bool, resume_requested: str | None, overwrite: bool):
        self.path, self.is_main = path, is_main
        self.resuming, self.resume_requested, self.overwrite = resuming, resume_requested, overwrite
        self.staging = path / ".staging"
        self.replaced: Path | None = None
        self._created: list[Path] = []
        self.earlier = [name for name in RUN_OUTPUTS if (path / name).exists()]
        """Outputs of an earlier run found in the directory."""

    def check(self) -> str | None:
        """Refuse a directory holding another run unless resuming it or overwriting it; returns a warning to print,
        if any. Reads only."""
        if self.resume_requested and not self.resuming and not self.earlier:
            if self.resume_requested != "--resume":
                return None  # train.resume: auto starts every new run this way: nothing to say
            return f"--resume: no checkpoint in {self.path} (nothing was run there); starting a fresh run"
        if not self.earlier or self.resuming or self.overwrite:
            return None
        if not self.resume_requested:
            raise RunDirError(f"{self.path} already holds a run ({', '.join(self.earlier)}); resume it with --resume, "
                              f"choose another run.name or run.out_dir, set run.version=number to give each new run "
                              f"a folder of its own, or set run.overwrite=true to replace it")
        if "final" in self.earlier:
            raise RunDirError(f"{self.path} holds a finished model (final/) but no usable checkpoint to resume from; "
                              f"set run.overwrite=true to train it again, or choose another run.out_dir")
        return (f"{self.path}: no usable checkpoint to resume from; starting a fresh run (the earlier attempt's "
                f"{', '.join(self.earlier)} will be kept in {self.path / 'earlier-<time>'})")

    @property
    def build_dir(self) -> Path:
        """Where a task may write while it builds its data: the run directory itself when resuming (its tokenizer is
        there), else the staging folder."""
        return self.path if self.resuming else self.staging

    @contextlib.contextmanager
    def building(self):
        """Around building data, model and optimizers: creates the staging folder; on any error removes it and the
        folders created for it (the run directory and its parents, when they did not exist)."""
        if self.is_main and not self.resuming:
            missing = [p for p in (self.staging, *self.staging.parents) if not p.exists()]
            try:
                shutil.rmtree(self.staging, ignore_errors=True)  # a killed run's leftovers
                self.staging.mkdir(parents=True)
            except OSError as e:
                raise RunDirError(f"cannot write to run directory {self.path}: {e.strerror or e}") from None
            self._created = missing  # deepest first
        try:
            yield self.build_dir
        except BaseException:
            if self.is_main and not self.resuming:
                shutil.rmtree(self.staging, ignore_errors=True)
                for folder in self._created[1:]:
                    with contextlib.suppress(OSError):
                        folder.rmdir()  # only if still empty
            raise

    def commit(self, recipe_yaml: str) -> None:
        """Every check has passed: move an earlier run's outputs aside, the staged files in, write the recipe."""
        if not self.is_main:
            RUN_LOG.open(self.path / "train.log")  # opened at its first line (the main process makes the folder)
            return
        try:
            if not self.resuming and self.earlier:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                aside = self.path / (f".replaced-{stamp}" if self.overwrite else f"earlier-{stamp}")
                aside.mkdir()
                for name in self.earlier:
                    os.replace(self.path / name, aside / name)
                self.replaced = aside if self.overwrite else None
            if self.staging.exists():
                for item in self.staging.iterdir():
                    os.replace(item, self.path / item.name)
                self.staging.rmdir()
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path / "recipe.yaml", recipe_yaml)
            RUN_LOG.open(self.path / "train.log")
        except OSError as e:
            raise RunDirError(f"cannot write to run directory {self.path}: {e.strerror or e}") from None

    def drop_replaced(self) -> None:
        """The new run has started: delete the outputs it replaced."""
        if self.is_main and self.replaced is not None:
            shutil.rmtree(self.replaced, ignore_errors=True)
            self.replaced = None


def versioned_dir(root: Path, name: str, how: str, resuming: bool) -> Path:
    """`run.version`: the folder under `root` for a run named `name`. A new run gets the one after the newest that
    holds a run (`number`: `name`, `name-1`, ...; `time`: `name-YYYYmmdd-HHMMSS`); a resumed one, the newest."""
    pattern = re.compile(re.escape(name) + (r"(?:-(\d+))?" if how == "number" else r"-(\d{8}-\d{6})"))
    found = []
    for path in root.glob(f"{glob.escape(name)}*"):
        match = pattern.fullmatch(path.name)
        if match and path.is_dir() and any((path / out).exists() for out in RUN_OUTPUTS):
            found.append((int(match.group(1) or 0) if how == "number" else match.group(1), path))
    if resuming and found:
        return max(found)[1]
    if how == "time":
        return root / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    number = max(found)[0] + 1 if found else 0
    return root / (f"{name}-{number}" if number else name)


def with_version(recipe, resuming: bool):
    """The recipe with `run.out_dir` set to the folder `run.version` picks (by the main process, the same for all),
    which the run's own recipe.yaml then names: resuming it from the run directory finds the same folder."""
    if recipe.run.version == "none" or recipe.run.out_dir is not None:
        return recipe
    PartialState()  # the processes' group, for the broadcast
    choice = [str(versioned_dir(recipe.run.dir.parent, recipe.run.name, recipe.run.version, resuming))]  # runs/
    broadcast_object_list(choice)  # from the main process: the clock or the folders may differ elsewhere
    return recipe.model_copy(update={"run": recipe.run.model_copy(update={"out_dir": choice[0]})})
