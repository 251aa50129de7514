"""`s4accel show`: the model a recipe trains, as its task builds it, on the meta device (shapes only, no memory)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..config import Recipe


def summary_model(recipe: Recipe):
    """(the task, its model on the meta device). The task gets a throwaway build folder: nothing is written to the
    run directory."""
    import torch
    from accelerate import Accelerator

    from ..training.task import TaskContext, load_task

    task = load_task(recipe)
    with tempfile.TemporaryDirectory(prefix="s4accel-show-") as tmp:
        task.setup(TaskContext(Accelerator(cpu=not torch.accelerator.is_available()), recipe.run.dir, Path(tmp)))
        return task, task.summary_model()


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
