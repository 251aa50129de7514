"""Every recipe shipped in recipes/ and recipes/lra/ validates and builds its model config (no training); the LRA
recipes, whose data is not here, read stand-in files in their source's layout."""

from pathlib import Path

import pytest

from helpers import RECIPES
from lra_files import write_for
from s4accel.config import load_recipe
from s4accel.training.tasks_builtin import build_model

ALL = sorted(RECIPES.glob("*.yaml"))
LRA = sorted((RECIPES / "lra").glob("*.yaml"))


def test_there_are_recipes():
    assert {p.name for p in ALL} >= {"quickstart.yaml", "s4_tiny_debug.yaml"}
    assert {p.stem for p in LRA} == {"listops", "text", "retrieval", "image", "pathfinder", "pathx"}


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


@pytest.mark.parametrize("path", LRA, ids=[p.stem for p in LRA])
def test_lra_recipe_loads_and_builds_its_model_config_from_files_in_its_sources_layout(path, tmp_path, hf_cache):
    recipe = load_recipe(path)
    assert recipe.data.path and recipe.model.overrides["bidirectional"] and recipe.train.clip_grad_norm is None
    assert recipe.train.max_epochs and recipe.train.max_steps is None  # the papers count epochs
    folder = write_for(recipe, tmp_path / "data")
    recipe = load_recipe(path, [f"data.path={folder}", f"data.cache_dir={tmp_path / 'cache'}"])
    model = build_model(recipe, None, device="meta")
    assert model.config.l_max >= recipe.data.seq_len or recipe.data.source in ("lra_image", "lra_pathfinder")
    assert model.config.num_labels == {"lra_listops": 10, "lra_image": 10}.get(recipe.data.source, 2)
    assert (model.config.d_input == 1) == (recipe.data.source in ("lra_image", "lra_pathfinder"))


@pytest.mark.parametrize("path", LRA, ids=[p.stem for p in LRA])
def test_show_of_an_lra_recipe_whose_data_is_absent_shows_the_model_the_data_would_give(path, tmp_path, hf_cache):
    from s4accel.tools.summary import summary_model

    cache = f"data.cache_dir={tmp_path / 'cache'}"
    _, shown, note = summary_model(load_recipe(path, [f"data.path={tmp_path / 'not-here'}", cache]))
    assert note.startswith("# note: the data could not be read (data.path: ") and "not-here" in note
    folder = write_for(load_recipe(path), tmp_path / "data")
    _, built, no_note = summary_model(load_recipe(path, [f"data.path={folder}", cache]))
    assert no_note is None
    fields = ("vocab_size", "d_input", "num_labels", "n_layer", "d_model")
    assert [getattr(shown.config, k, None) for k in fields] == [getattr(built.config, k, None) for k in fields]
    assert sum(p.numel() for p in shown.parameters()) == sum(p.numel() for p in built.parameters())


EXAMPLES = sorted((RECIPES.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_recipe_loads_and_imports_its_task(path, tmp_path, monkeypatch):
    from s4accel.training.task import Task, load_task

    monkeypatch.chdir(tmp_path)  # anywhere: the examples name their task files relative to themselves
    task = load_task(load_recipe(path))
    assert isinstance(task, Task) and type(task).__module__.startswith("s4accel_task_")


def test_each_family_names_the_config_class_that_builds_it():
    """Recipes are checked against the config's fields read from its file (no torch); the model is built from the
    class itself: both must be the same class."""
    from s4accel.config.sizes import FAMILIES, config_fields
    from s4accel.training.tasks_builtin import CONFIG_CLASSES

    assert set(FAMILIES) == set(CONFIG_CLASSES)
    for family, (module, name) in FAMILIES.items():
        cls = CONFIG_CLASSES[family]
        assert (cls.__module__, cls.__name__) == (f"s4accel.models.{module}", name)
        assert set(config_fields(family)) <= set(cls().to_dict())
