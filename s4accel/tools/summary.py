"""`s4accel show`: the model a recipe trains, as its task builds it, on the meta device (shapes only, no memory)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..config import Recipe
from ..config.optim_sections import TORCH_OPTIMIZERS
from ..data import recipe_spec
from ..errors import DataError
from ..training.optim import build_optimizers, check_optimizer
from ..training.pretrained import freeze
from ..training.setup import make_accelerator, setup_task
from ..training.task import Task
from ..training.tasks_builtin import CausalLMTask, SequenceClassificationTask, build_model


def summary_model(recipe: Recipe):
    """(the task, its model on the meta device, a note or None). The task gets a throwaway build folder: nothing is
    written to the run directory. A built-in task whose data is not on this machine (an LRA release not downloaded)
    shows the model the recipe describes, with a note naming what it could not read and what it assumed."""
    with tempfile.TemporaryDirectory(prefix="s4accel-show-") as tmp:
        task, _ = setup_task(recipe, make_accelerator(recipe, trackers=False), Path(tmp))
        try:
            return task, task.summary_model(), None
        except DataError as e:
            if type(task) not in (CausalLMTask, SequenceClassificationTask):
                raise  # a task of your own sizes its model its own way
            spec, assumed = recipe_spec(recipe.data)
            note = f"# note: the data could not be read ({e}); the model is as the recipe describes it" + (
                f", with {assumed} assumed" if assumed else "")
            return task, build_model(recipe, None, device="meta", spec=spec), note


def describe(recipe: Recipe, task, model) -> str:
    """One line: the size name and model type (or the task's own module), parameters, what it reads."""
    n_params = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) is None:
        return f"# model: {type(model).__name__} ({type(task).__name__}), {n_params:,} parameters"
    inputs = f"vocab {config.vocab_size}" if getattr(config, "d_input", None) is None else \
        f"{config.d_input} feature(s) per step"
    if type(model).__name__.endswith("ForSequenceClassification"):
        inputs += f", {config.num_labels} label(s)"
    name = recipe.model.name or recipe.model.pretrained
    return f"# model: {name} ({config.model_type}), {n_params:,} parameters, {inputs}"


def optimizer_line(recipe: Recipe, task, model) -> str:
    """One line: the optimizer `train` builds (its arguments checked as `train` checks them) and its parameter
    groups with their weights, rate and weight decay: where S4's SSM parameters go, before a run."""
    if type(task).build_optimizers is not Task.build_optimizers:
        return f"# optimizer: {type(task).__name__}.build_optimizers (the task's own)"
    cfg = recipe.optim
    check_optimizer(cfg, "cpu")
    if recipe.model.freeze:  # the throwaway model: fixed parameters are in no group, as in a run
        freeze(model, recipe.model.freeze)
    parts = []
    for role, optimizer in build_optimizers(model, cfg, "meta"):  # as the run builds them, on the shapes-only model
        cls = type(optimizer)
        name = f"torch.optim.{cls.__name__}" if cfg.name in TORCH_OPTIMIZERS else cfg.name
        # the recipe's kwargs are the main optimizer's (Muon's beside its AdamW)
        kwargs = ", ".join(f"{k} {v}" for k, v in cfg.kwargs.items()) if role in ("main", "muon") else ""
        groups = [f"{g['name']} {sum(p.numel() for p in g['params']):,} (lr {g['lr']:g}"
                  + (f", weight decay {g['weight_decay']:g})" if g["weight_decay"] else ")")
                  for g in optimizer.param_groups]
        parts.append(f"{name}{f' ({kwargs})' if kwargs else ''}; {'; '.join(groups)}")
    return f"# optimizer: {' | '.join(parts)}"


CONTAINERS = ("ModuleList", "ModuleDict", "Sequential")
"""Modules that only hold others: not a level of the summary (the blocks of `layers` are one level, not two)."""


def layer_table(model, depth: int = 2) -> list[str]:
    """A per-layer summary as `#` lines (the output of `show` stays YAML): each module with parameters down to
    `depth` levels (containers are no level), indented under its parent, with its type and parameter count. A tensor
    shared by two modules (tied input and output embeddings) counts where it first appears; the other row names it.
    The top-level rows add up to the model's total."""
    first = {id(p): name for name, p in model.named_parameters()}  # named_parameters yields a shared tensor once
    rows, width = [], 0
    for name, module in model.named_modules():
        if not name or type(module).__name__ in CONTAINERS:
            continue
        parts = name.split(".")
        level = sum(1 for i in range(len(parts)) if type(model.get_submodule(".".join(parts[:i + 1])))
                    .__name__ not in CONTAINERS)
        params = list(module.parameters())
        if level > depth or not params:
            continue
        own = sum(p.numel() for p in params if first[id(p)].startswith(name + "."))
        shared = sorted({first[id(p)] for p in params if not first[id(p)].startswith(name + ".")})
        label = "  " * (level - 1) + name
        width = max(width, len(label))
        rows.append((label, type(module).__name__, own, f"  (shares {', '.join(shared)})" if shared else ""))
    width = max(width, len("layer"))
    return [f"# {'layer':<{width}}  {'type':<24} {'parameters':>12}",
            *(f"# {label:<{width}}  {kind:<24} {own:>12,}{note}" for label, kind, own, note in rows)]
