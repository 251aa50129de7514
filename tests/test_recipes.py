"""Every recipe shipped in recipes/ validates and builds its model config (no training)."""

from pathlib import Path

import pytest

from helpers import RECIPES
from s4accel.config import load_recipe
from s4accel.training.tasks_builtin import build_model

ALL = sorted(RECIPES.glob("*.yaml"))


def test_there_are_recipes():
    assert {p.name for p in ALL} >= {"quickstart.yaml", "s4_tiny_debug.yaml"}


def _stand_in_for_the_run_it_fine_tunes(recipe, where):
    """A fine-tuning recipe names the run directory another shipped recipe writes (runs/quickstart): a fresh clone
    has no such run, so that recipe's untrained model is saved as the run's `final/` under `where`."""
    writers = [r for r in map(load_recipe, ALL) if r.run.dir == Path(recipe.model.pretrained)]
    assert writers, f"{recipe.model.pretrained}: no recipe in recipes/ writes this run directory"
    build_model(writers[0], None).save_pretrained(where / writers[0].run.dir / "final")


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_recipe_loads_and_builds_its_model_config(path, tmp_path, monkeypatch):
    recipe = load_recipe(path)
    if recipe.model.pretrained is not None and not Path(recipe.model.pretrained).is_absolute():
        _stand_in_for_the_run_it_fine_tunes(recipe, tmp_path)
        monkeypatch.chdir(tmp_path)
    model = build_model(recipe, None, device="meta")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert recipe.train.max_steps >= 1


EXAMPLES = sorted((RECIPES.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_recipe_loads_and_imports_its_task(path, tmp_path, monkeypatch):
    from s4accel.training.task import Task, load_task

    monkeypatch.chdir(tmp_path)  # anywhere: the examples name their task files relative to themselves
    task = load_task(load_recipe(path))
    assert isinstance(task, Task) and type(task).__module__.startswith("s4accel_task_")
