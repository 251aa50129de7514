"""Metrics of your own without writing a Task: `task.metrics: [module:function, file.py:function]` in a recipe.

    def balanced_error(predictions, labels):   # mymetrics.py; recipe: task: {metrics: [mymetrics.py:balanced_error]}
        ...
        return 0.12                              # logged as eval/balanced_error; a dict: one metric per key

Each function gets two 1-D torch tensors on the CPU holding every evaluated sample once, gathered from all processes
(`gather_for_metrics` drops the duplicates that pad the last batch), paired but in no particular order: for a
classifier the predicted and the true class ids (int64), for a regressor the predicted and the true values (float64);
a task of your own hands over whatever its `validation_step` returns as `prediction` and `label` (both listed in its
`gathered`). It returns a number, named after the function, or a dict of numbers by name. The functions are imported
and checked (callable with two positional arguments) when the task is loaded, before any compute; what they return
is checked at the first evaluation."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...errors import RecipeError
from ..imports import import_object

GATHERED = ("prediction", "label")
"""The per-sample values a task must gather (`Task.gathered`) for the recipe's functions to score."""


class MetricFunction(NamedTuple):
    target: str
    """As the recipe names it: `package.module:function` or `path/file.py:function`."""
    name: str
    """The metric's name when the function returns a number: the function's own."""
    function: Callable


def metric_functions(recipe, task) -> list[MetricFunction]:
    """The recipe's `task.metrics`, imported and checked; a task that gathers no predictions and labels to hand them
    is refused (`task`: the loaded task)."""
    functions = []
    for target in recipe.task.metrics:
        function = import_object(target, "task.metrics")
        if not callable(function):
            raise RecipeError(f"task.metrics: {target} is not a function")
        try:
            inspect.signature(function).bind(None, None)
        except TypeError:
            raise RecipeError(f"task.metrics: {target} must take (predictions, labels); it takes "
                              f"{inspect.signature(function)}") from None
        except ValueError:  # a callable without a signature Python can read (a C function): called as it is
            pass
        functions.append(MetricFunction(target, target.rpartition(":")[2].rsplit(".", 1)[-1], function))
    if functions and not set(GATHERED) <= set(task.gathered):
        raise RecipeError(f"task.metrics: {type(task).__name__} gathers no per-sample predictions and labels to hand "
                          f"the functions (its validation_step returns {' and '.join(GATHERED)}, listed in its "
                          f"gathered, for a task of your own; the classification task does)")
    return functions


def recipe_metrics(functions: list[MetricFunction], values: dict, reported: dict,
                   say: Callable[[str], None] | None = None) -> dict[str, float | int]:
    """The functions' metrics on the gathered `values["prediction"]` and `values["label"]`; `reported`: the task's
    own metrics, whose names a function may not take. A function that raises gets one line through `say` and NaN
    under its name, this evaluation: a user's metric must not cost the run its trained model."""
    out = {}
    for f in functions:
        try:
            result = f.function(values["prediction"], values["label"])
        except Exception as e:
            detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            if say is not None:
                say(f"task.metrics: {f.target} raised {type(e).__name__} ({detail}); {f.name} is nan this time")
            out[f.name] = float("nan")
            continue
        items = result.items() if isinstance(result, dict) else [(f.name, result)]
        for key, value in items:
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, numbers.Real):
                shown = repr(result)
                raise RecipeError(f"task.metrics: {f.target} returned {shown[:80]}{'...' if len(shown) > 80 else ''}; "
                                  f"expected a number, or a dict of numbers by name")
            if key in reported or key in out:
                raise RecipeError(f"task.metrics: {f.target} reports {key!r}, which is reported already; give it "
                                  f"another name")
            out[key] = value if isinstance(value, numbers.Integral) else float(value)  # a count stays a count
    return out
