"""Every recipe shipped in recipes/ validates and builds its model config (no training)."""

import pytest

from conftest import RECIPES
from s4accel.config import build_model_config, load_recipe
from s4accel.data import auto_model_class, data_spec

ALL = sorted(RECIPES.glob("*.yaml"))


def test_there_are_recipes():
    assert {p.name for p in ALL} >= {"quickstart.yaml", "s4_tiny_debug.yaml"}


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_recipe_loads_and_builds_its_model_config(path):
    import torch

    recipe = load_recipe(path)
    config = build_model_config(recipe.model, **data_spec(recipe.data))
    with torch.device("meta"):
        model = auto_model_class(recipe.data).from_config(config)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert recipe.train.max_steps >= 1


EXAMPLES = sorted((RECIPES.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_recipe_loads_and_imports_its_task(path, monkeypatch):
    from s4accel.tasks import Task, load_task

    monkeypatch.chdir(RECIPES.parent)  # the examples name their task files relative to the repository root
    task = load_task(load_recipe(path))
    assert isinstance(task, Task) and type(task).__module__.startswith("s4accel_task_")
