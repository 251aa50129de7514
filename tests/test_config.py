"""Recipes: YAML -> typed config, overrides, and the one-line errors a user sees."""

import json
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, TINY, run_cli, sets, small_text_file
from s4accel.config import Recipe, load_recipe
from s4accel.errors import RecipeError


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path, overrides=()):
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return str(info.value)


def test_yaml_becomes_typed_sections_with_defaults(tmp_path):
    r = load_recipe(write(tmp_path, "optim: {lr: 1.0e-2}\ntrain: {max_steps: 7}\n"))
    assert isinstance(r, Recipe)
    assert r.optim.lr == 0.01 and r.train.max_steps == 7
    assert r.optim.ssm_lr == 1e-3  # default
    assert str(r.run.dir) == "runs/run"


def test_yaml_1_1_exponent_without_dot_still_parses_as_float(tmp_path):
    # PyYAML reads `1e-3` as a string; the schema turns it into the float the user meant.
    assert load_recipe(write(tmp_path, "optim: {lr: 1e-3}\n")).optim.lr == 1e-3


@pytest.mark.parametrize("value", ["no", "off", "false"])
def test_no_and_off_mean_no_mixed_precision_in_a_file_and_in_set(tmp_path, value):
    """YAML 1.1 reads `no` and `off` as false; the documented `mixed_precision: no` must not be refused for it."""
    assert load_recipe(write(tmp_path, f"train: {{mixed_precision: {value}}}\n")).train.mixed_precision == "no"
    assert load_recipe(TINY, [f"train.mixed_precision={value}"]).train.mixed_precision == "no"


def test_yes_no_on_off_are_words_where_text_is_expected_and_booleans_where_a_flag_is(tmp_path):
    """Recipes follow YAML 1.2: only true and false are booleans, so `run.name: no` is the name "no"; a flag still
    takes yes/no/on/off."""
    recipe = write(tmp_path, "run: {name: no, overwrite: yes}\nlog: {progress_bar: off}\n")
    r = load_recipe(recipe, ["sample.prompts=[on, yes]"])
    assert r.run.name == "no" and r.run.overwrite is True and r.log.progress_bar is False
    assert r.sample.prompts == ["on", "yes"]


def test_set_overrides_take_precedence_and_are_yaml_parsed(tmp_path):
    path = write(tmp_path, "optim: {lr: 1.0e-2}\n")
    r = load_recipe(path, ["optim.lr=5e-4", "train.mixed_precision=bf16", "log.log_with=[jsonl]",
                           "model.overrides.dropout=0.1", "optim.betas=[0.8, 0.9]"])
    assert r.optim.lr == 5e-4
    assert r.train.mixed_precision == "bf16"
    assert r.log.log_with == ["jsonl"]
    assert r.model.overrides == {"dropout": 0.1}
    assert r.optim.betas == (0.8, 0.9)


def test_unknown_key_names_the_path_and_suggests(tmp_path):
    msg = error_of(write(tmp_path, "optim: {lrr: 1.0}\n"))
    assert "optim.lrr: unknown key (did you mean 'lr'?)" in msg
    assert "allowed: name, kwargs, lr, weight_decay" in msg
    assert "\n" not in msg


def test_unknown_section_suggests(tmp_path):
    assert "optimm: unknown key (did you mean 'optim'?)" in error_of(write(tmp_path, "optimm: {}\n"))


def test_wrong_type_and_bad_value_name_the_key(tmp_path):
    path = write(tmp_path, "train: {max_steps: many}\n")
    assert "train.max_steps: Input should be a valid integer" in error_of(path)
    assert "train.max_steps: Input should be greater than or equal to 1" in error_of(path, ["train.max_steps=0"])
    msg = error_of(path, ["train.max_steps=3", "train.mixed_precision=fp8"])
    assert "train.mixed_precision: Input should be 'no', 'fp16' or 'bf16' (got 'fp8')" in msg
    assert "train.resume: Input should be 'auto' (got 'always')" in error_of(path, ["train.max_steps=3",
                                                                                    "train.resume=always"])


@pytest.mark.parametrize("value, seconds", [
    ("90m", 5400), ("1h30m", 5400), ("1.5h", 5400), ("2d", 172800), ("1d12h", 129600), ("45s", 45),
    ("'01:30:00'", 5400), ("1:30:00", 5400), ("'00:01:30:00'", 5400), ("1-12:00:00", 129600), ("'30:00'", 1800),
    ("30:00", 1800), ("3600", 3600), ("2.5", 2.5), ("{hours: 1, minutes: 30}", 5400),
])
def test_max_time_reads_lightnings_slurms_and_unit_forms_as_seconds(value, seconds):
    """Lightning's DD:HH:MM:SS and mapping, SLURM's --time forms (two fields are minutes:seconds, as YAML's base-60
    numbers read them unquoted), units, or seconds; the recipe keeps what was written."""
    train = load_recipe(TINY, [f"train.max_time={value}"]).train
    assert train.max_time_s == seconds
    assert load_recipe(TINY).train.max_time is None and load_recipe(TINY).train.max_time_s is None


@pytest.mark.parametrize("value, said", [
    ("soon", "expected a duration (e.g. 90m, 1h30m, 2d, 01:30:00, 1-12:00:00 or a number of seconds), got 'soon'"),
    ("0", "expected a duration greater than 0"), ("-5m", "expected a duration"), ("true", "expected a duration"),
    ("'1:75'", "minutes and seconds are below 60 in HH:MM:SS, got '1:75'"), ("1h30", "expected a duration"),
    ("{hours: 1, weeks: 2}", "expected a mapping of days, hours, minutes and seconds to numbers"),
])
def test_a_wrong_max_time_is_one_line_naming_the_key(value, said):
    msg = error_of(TINY, [f"train.max_time={value}"])
    assert msg.startswith(f"{TINY}: train.max_time: ") and said in msg and "\n" not in msg


def test_override_typo_is_caught_like_a_file_typo(tmp_path):
    assert "train.grad_acum: unknown key (did you mean 'grad_accum'?)" in error_of(TINY, ["train.grad_acum=2"])


def test_bad_override_syntax(tmp_path):
    assert "expected section.key=value" in error_of(TINY, ["optim.lr"])
    assert "optim.lr is not a section" in error_of(TINY, ["optim.lr.x=1"])


def test_model_name_and_override_keys_are_checked_without_torch(tmp_path):
    msg = error_of(TINY, ["model.name=s4-smal"])
    assert "model.name: unknown model size 's4-smal' (did you mean 's4-small'?)" in msg
    msg = error_of(TINY, ["model.overrides.d_modle=8"])
    assert "model.overrides: unknown key 'd_modle' (did you mean 'd_model'?)" in msg
    assert "set from the tokenizer" in error_of(TINY, ["model.overrides.vocab_size=8"])


def test_model_override_values_are_checked_by_the_config_class():
    from s4accel.training.tasks_builtin import model_config as build_model_config

    r = load_recipe(TINY, ["model.overrides.d_model=big"])
    with pytest.raises(RecipeError, match=r"model.overrides.d_model: .*expected int, got str"):
        build_model_config(r.model, vocab_size=10)
    r = load_recipe(TINY, ["model.overrides.d_state=3"])
    with pytest.raises(RecipeError, match="d_state must be an even number"):
        build_model_config(r.model, vocab_size=10)


def test_cross_field_checks(tmp_path):
    assert "clip_grad_norm or clip_grad_value" in error_of(TINY, ["train.clip_grad_value=1"])
    assert "warmup_steps or warmup_ratio" in error_of(TINY, ["scheduler.warmup_ratio=0.1"])
    assert "needs a non-empty data.files" in error_of(TINY, ["data.source=files"])


def test_file_problems(tmp_path):
    assert "recipe file not found" in error_of(tmp_path / "nope.yaml")
    assert "invalid YAML at line 3, column 1" in error_of(write(tmp_path, "run:\n  name: [unclosed\n"))
    assert "must be a mapping" in error_of(write(tmp_path, "- a\n- b\n"))


def test_warmup_ratio_is_converted_to_steps():
    r = load_recipe(TINY, ["scheduler.warmup_steps=0", "scheduler.warmup_ratio=0.25", "train.max_steps=10"])
    assert r.warmup_steps == 3


def test_cli_recipe_error_is_one_line_exit_2_no_traceback(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("train", TINY, "--set", f"run.out_dir={run_dir}", "--set", "optim.lrr=1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {TINY}: optim.lrr: unknown key (did you mean 'lr'?); allowed: name, kwargs, lr, weight_decay, betas, "
        "eps, ssm_lr, ssm_params, fused"]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run_dir.exists()  # nothing is created before the recipe validates


def test_recipe_errors_do_not_import_torch_or_transformers():
    """`s4accel --help` and recipe errors stay fast: the heavy libraries load only when work needs them."""
    code = ("import sys; from s4accel.cli import app; from s4accel.config import load_recipe\n"
            f"load_recipe({str(TINY)!r}, ['optim.lr=1e-3'])\n"
            "heavy = [m for m in ('torch', 'transformers', 'datasets', 'accelerate') if m in sys.modules]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_show_prints_resolved_recipe_and_parameter_count():
    proc = run_cli("show", TINY, "--set", "optim.lr=0.5")
    assert proc.returncode == 0, proc.stderr
    assert "lr: 0.5" in proc.stdout
    assert "# model: s4-tiny (s4accel-s4), 37,952 parameters, vocab 259" in proc.stdout


def test_a_recipe_never_changes_after_it_is_loaded():
    """What the data decides (the length of a run in epochs) lives in the run's plan, not written back into the
    recipe: every part of a run reads the recipe it was validated as."""
    import pydantic

    recipe = load_recipe(TINY, ["train.max_steps=null", "train.max_epochs=2", "scheduler.warmup_ratio=0.1",
                                "scheduler.warmup_steps=0"])
    before = recipe.to_yaml()
    for section, key, value in (("train", "max_steps", 5), ("optim", "lr", 1.0), ("data", "seq_len", 8)):
        with pytest.raises(pydantic.ValidationError, match="frozen"):
            setattr(getattr(recipe, section), key, value)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        recipe.train = recipe.train
    assert not hasattr(recipe, "set_epoch_length") and recipe.to_yaml() == before


def test_show_prints_a_per_layer_summary_whose_top_rows_add_up():
    import yaml

    proc = run_cli("show", TINY)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["model"]["name"] == "s4-tiny"  # still YAML: the table is comments
    rows = [line[2:] for line in proc.stdout.splitlines()
            if line.startswith("# ") and not line.startswith(("# model", "# optimizer"))]
    assert rows[0].split() == ["layer", "type", "parameters"]
    table = {r.split()[0]: (r.split()[1], int(r.split()[2].replace(",", ""))) for r in rows[1:]}
    assert table["backbone.layers.0"] == ("S4Block", 10_624) and table["backbone.layers.1"] == ("S4Block", 10_624)
    assert "backbone.layers" not in table  # a container is no level: its blocks are
    top = [r for r in rows[1:] if not r.startswith(" ")]
    assert sum(int(r.split()[2].replace(",", "")) for r in top) == 37_952  # the total on the last line
    lm_head = next(r for r in rows if r.startswith("lm_head"))
    assert "(shares backbone.embeddings.weight)" in lm_head  # tied to the input embedding, counted once

    deeper = run_cli("show", TINY, "--depth", "3").stdout
    assert "backbone.layers.0.layer " in deeper and "backbone.layers.0.layer " not in proc.stdout
    assert not any(line.startswith("# layer") for line in run_cli("show", TINY, "--depth", "0").stdout.splitlines())


def test_relative_paths_in_a_recipe_mean_files_next_to_it_and_set_ones_the_current_directory(tmp_path):
    """A project folder (recipe, text, callback file) trained from elsewhere; a --set path is the shell's."""
    import yaml

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "data" / "text.txt").write_text(small_text_file(tmp_path).read_text())
    (project / "hooks.py").write_text(
        "import json\nfrom s4accel import Callback\n\n\nclass Note(Callback):\n"
        "    def on_train_end(self, run):\n"
        "        (run.run_dir / 'note.json').write_text(json.dumps(run.state.step))\n")
    recipe = yaml.safe_load((REPO / "recipes" / "s4_tiny_debug.yaml").read_text())
    recipe.update(data={**recipe["data"], "source": "files", "files": ["data/*.txt"], "seq_len": 32},
                  train={**recipe["train"], "max_steps": 3}, callbacks=[{"target": "hooks.py:Note"}],
                  sample={"prompts": []})
    (project / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    proc = run_cli("train", project / "recipe.yaml", *sets(f"run.out_dir={run}", "log.progress_bar=false"),
                   cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run / "note.json").read_text()) == 3  # the callback from the recipe's folder ran
    kept = yaml.safe_load((run / "recipe.yaml").read_text())
    assert kept["data"]["files"] == [str(project / "data" / "*.txt")]  # absolute: resumable from anywhere
    assert kept["callbacks"][0]["target"] == f"{project / 'hooks.py'}:Note"

    # --set paths are the current directory's: a text in `elsewhere`, none of that name next to the recipe
    (elsewhere / "other.txt").write_text((project / "data" / "text.txt").read_text())
    proc = run_cli("show", project / "recipe.yaml", *sets("data.files=[other.txt]"), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["data"]["files"] == [str(elsewhere / "other.txt")]
    # a path found nowhere stays as written, for the data code to report
    proc = run_cli("train", project / "recipe.yaml", *sets(f"run.out_dir={tmp_path / 'r2'}", "data.files=[nope.txt]"),
                   cwd=elsewhere)
    assert proc.returncode == 2 and "nope.txt" in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_a_bad_model_override_is_reported_before_the_data_is_read(tmp_path):
    # the data file does not exist: an error about it would mean the data was read first
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run'}", "data.source=files",
                                        f"data.files=[{tmp_path / 'missing.txt'}]", "model.overrides={d_model: -3}"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: model.overrides") and "d_model" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where, expected", [
    ("learning_rate: 1.0e-3\n", "learning_rate: unknown key; learning_rate is transformers.Trainer's and "
                                "Lightning's name: in a recipe it is optim.lr"),
    ("train: {eval_steps: 50}\n", "train.eval_steps: unknown key; eval_steps is transformers.Trainer's name: in a "
                                  "recipe it is train.eval_every"),
    ("train: {save_steps: 50}\n", "train.save_steps: unknown key; save_steps is transformers.Trainer's name: in a "
                                  "recipe it is checkpoint.every_steps"),
    ("optim: {gradient_accumulation_steps: 4}\n", "optim.gradient_accumulation_steps: unknown key; "
                                                  "gradient_accumulation_steps is transformers.Trainer's name: in a "
                                                  "recipe it is train.grad_accum"),
    ("train: {warmup_ratio: 0.1}\n", "train.warmup_ratio: unknown key; warmup_ratio is transformers.Trainer's name: "
                                     "in a recipe it is scheduler.warmup_ratio"),
    ("accumulate_grad_batches: 4\n", "accumulate_grad_batches: unknown key; accumulate_grad_batches is Lightning's "
                                     "name: in a recipe it is train.grad_accum"),
    ("max_time: 00:12:00:00\n", "max_time: unknown key; max_time is Lightning's name: in a recipe it is "
                                "train.max_time"),
    ("train: {fast_dev_run: true}\n", "train.fast_dev_run: unknown key; fast_dev_run is Lightning's name: not a "
                                      "recipe key: s4accel train RECIPE --fast-dev-run [N] checks a run end to end"),
])
def test_a_trainer_or_lightning_name_is_answered_with_the_recipes_name_for_it(tmp_path, where, expected):
    """`eval_steps` used to get "did you mean 'max_steps'?", `learning_rate` the list of sections."""
    msg = error_of(write(tmp_path, where))
    assert msg == f"{tmp_path / 'r.yaml'}: {expected}" and "\n" not in msg


@pytest.mark.parametrize("item, name, place", [
    ("fp16=true", "fp16", "train.mixed_precision: fp16"), ("train.bf16=true", "bf16", "train.mixed_precision: bf16"),
    ("report_to=[wandb]", "report_to", "log.log_with"), ("log.report_to=[wandb]", "report_to", "log.log_with"),
    ("train.load_best_model_at_end=true", "load_best_model_at_end", "checkpoint.best_at_end"),
    ("data.per_device_train_batch_size=8", "per_device_train_batch_size", "data.batch_size"),
    ("num_train_epochs=3", "num_train_epochs", "train.max_epochs"),
    ("train.learning_rate=1e-3", "learning_rate", "optim.lr"),
])
def test_a_trainer_name_given_with_set_says_where_it_goes(item, name, place):
    assert f"{name} is transformers.Trainer's" in error_of(TINY, [item])
    assert f"in a recipe it is {place}" in error_of(TINY, [item])


def test_cli_trainer_name_is_one_line_exit_2(tmp_path):
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run'}", "learning_rate=1e-3"))
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert proc.stderr.strip().splitlines() == [
        f"error: {TINY}: learning_rate: unknown key; learning_rate is transformers.Trainer's and Lightning's name: "
        "in a recipe it is optim.lr"]


def test_the_readme_table_of_trainer_names_is_the_one_the_errors_use():
    """One table in the code (config/trainer_names.py); the documentation's lists exactly its names."""
    import itertools
    import re

    from s4accel.config.trainer_names import TRAINER_NAMES

    readme = (REPO / "docs" / "reference" / "recipes.md").read_text()
    table = readme[readme.index("| transformers `TrainingArguments` |"):].splitlines()
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), table))[2:]  # after the header and |---|
    names = {n for row in rows for cell in row.split("|")[1:3] for n in re.findall(r"`(\w+)`", cell)}
    assert len(rows) > 10 and names == set(TRAINER_NAMES)


def test_a_published_recipe_lists_only_the_data_keys_that_apply_to_its_data():
    """A language model's published recipe listed `data.task: classification` and `normalize`, which only number
    sequences read; a number-sequence recipe keeps them, and the recipe without them loads as it was."""
    from s4accel.config.paths import portable_recipe

    text = load_recipe(TINY).to_dict()
    published = portable_recipe(text)[0]["data"]
    assert not {"task", "normalize", "ucr_name"} & set(published)
    assert load_recipe(REPO / "recipes" / "s4_tiny_debug.yaml").data == Recipe.model_validate(
        {**text, "data": published}).data
    arrays = portable_recipe(load_recipe(REPO / "recipes" / "ucr_gunpoint.yaml").to_dict())[0]["data"]
    assert {"task", "normalize", "ucr_name"} <= set(arrays)


def test_a_published_recipe_names_files_by_name_and_reads_them_next_to_itself(tmp_path):
    """What `s4accel push` and `export` publish beside a model: no path of the training machine, and a recipe that
    finds a user's own files placed under those names beside it."""
    import yaml

    from s4accel.config.paths import portable_recipe

    machine = tmp_path / "home" / "alice"
    raw = {"run": {"name": "r", "out_dir": str(machine / "runs" / "r")},
           "data": {"source": "files", "files": [str(machine / "corpus" / "*.parquet")], "tokenizer": "gpt2",
                    "val_files": [str(machine / "a" / "val.txt"), str(machine / "b" / "val.txt")],
                    "cache_dir": str(machine / "cache")},
           "model": {"name": "s4-tiny"}, "callbacks": [{"target": f"{machine / 'hooks.py'}:Note"}],
           "sample": {"prompts": ["/home is where the heart is"]}}
    published, renamed = portable_recipe(raw)
    assert published["data"]["files"] == ["corpus/*.parquet"]  # a glob keeps the folder it reads
    assert published["data"]["val_files"] == ["a/val.txt", "b/val.txt"]  # parents added until they differ
    assert published["callbacks"] == [{"target": "hooks.py:Note"}] and published["data"]["tokenizer"] == "gpt2"
    assert published["run"]["out_dir"] is None and published["data"]["cache_dir"] is None
    assert published["sample"] == raw["sample"] and str(machine) not in yaml.safe_dump(published)
    assert [(r.key, r.name) for r in renamed][:2] == [("data.files", "corpus/*.parquet"),
                                                      ("data.val_files", "a/val.txt")]

    bob = tmp_path / "bob"
    for name in ("corpus/x.parquet", "a/val.txt", "b/val.txt", "hooks.py"):
        (bob / name).parent.mkdir(parents=True, exist_ok=True)
        (bob / name).write_text("")
    (bob / "recipe.yaml").write_text(yaml.safe_dump(published))
    loaded = load_recipe(bob / "recipe.yaml")
    assert loaded.data.files == [str(bob / "corpus" / "*.parquet")]
    assert loaded.data.val_files == [str(bob / "a" / "val.txt"), str(bob / "b" / "val.txt")]
    assert loaded.callbacks[0].target == f"{bob / 'hooks.py'}:Note" and loaded.run.out_dir is None


@pytest.mark.parametrize("where", ["a --set value", "a recipe of lists", "a recipe of mappings"])
def test_a_recipe_nested_thousands_deep_is_one_line_not_a_recursion_error(tmp_path, where):
    """5,000 lists inside each other in `--set`, 3,000 in a recipe, 800 mappings: a RecursionError traceback."""
    if where == "a --set value":
        message = error_of(TINY, ["sample.prompts=" + "[" * 5000 + "]" * 5000])
    elif where == "a recipe of lists":
        message = error_of(write(tmp_path, "sample: {prompts: " + "[" * 3000 + "]" * 3000 + "}\n"))
    else:
        text = "".join(" " * i + f"k{i}:\n" for i in range(800)) + " " * 800 + "v: 1\n"
        message = error_of(write(tmp_path, text))
    assert "\n" not in message and ("nested too deeply" in message or "nests deeper than 50 levels" in message), \
        message[:300]
