"""Every recipe shipped in recipes/ validates and builds its model config (no training)."""

import pytest

from helpers import RECIPES
from s4accel.config import load_recipe
from s4accel.training.tasks_builtin import build_model

ALL = sorted(RECIPES.glob("*.yaml"))


def test_there_are_recipes():
    assert {p.name for p in ALL} >= {"quickstart.yaml", "s4_tiny_debug.yaml"}


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_recipe_loads_and_builds_its_model_config(path):
    recipe = load_recipe(path)
    model = build_model(recipe, None, device="meta")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert recipe.train.max_steps >= 1


EXAMPLES = sorted((RECIPES.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_recipe_loads_and_imports_its_task(path, monkeypatch):
    from s4accel.training.task import Task, load_task

    monkeypatch.chdir(RECIPES.parent)  # the examples name their task files relative to the repository root
    task = load_task(load_recipe(path))
    assert isinstance(task, Task) and type(task).__module__.startswith("s4accel_task_")
