"""`--fast-dev-run [N]` (Lightning's fast_dev_run): the run checked end to end in a scratch directory, the real run
directory untouched."""

import pytest

from helpers import TINY, callback_override, reset_accelerate, run_cli, sets
from s4accel.config import load_recipe
from s4accel.errors import RecipeError
from s4accel.tools.command_line import bare_fast_dev_run
from s4accel.tools.fast_dev_run import fast_dev_recipe, scratch_dir


def fast(overrides, steps, resume=None):
    import s4accel

    reset_accelerate()
    return s4accel.train(load_recipe(TINY, overrides), fast_dev_run=steps, resume=resume)


def test_the_recipe_is_cut_to_n_steps_an_evaluation_and_a_checkpoint_without_trackers_push_or_early_stop(tmp_path):
    recipe = load_recipe(TINY, [f"run.out_dir={tmp_path / 'run'}", "train.max_epochs=3", "train.eval_every=epoch",
                                "log.log_with=[jsonl, wandb]", "hub.push_at_end=true", "hub.repo_id=me/m",
                                "train.early_stopping={patience: 1}", "train.max_time=1h", "train.profile={}",
                                "checkpoint.keep_best=2", "scheduler.warmup_steps=50", "train.resume=auto"])
    cut = fast_dev_recipe(recipe, 3)
    assert cut.run.dir == (tmp_path / ".run.fast-dev-run") == scratch_dir(recipe.run.dir) and cut.run.overwrite
    t, c = cut.train, cut.checkpoint
    assert (t.max_steps, t.max_epochs, t.eval_every, t.eval_max_batches) == (3, None, 3, 3)
    assert (t.early_stopping, t.max_time, t.profile, t.resume) == (None, None, None, None)
    assert (c.every_steps, c.keep_best, c.best_at_end) == (3, 0, False)
    assert cut.log.log_with == [] and not cut.hub.push_at_end and cut.scheduler.warmup_steps == 3
    assert cut.model == recipe.model and cut.data == recipe.data and cut.optim == recipe.optim


def test_a_fast_dev_run_trains_evaluates_saves_and_exports_then_leaves_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    result = fast([f"run.out_dir={run}", "log.progress_bar=false", "train.eval_every=100"], 2)
    assert result.steps == 2 and not result.preempted and result.stop_reason is None
    assert set(result.eval_metrics) >= {"loss", "ppl"}
    printed = capsys.readouterr().out
    assert "step 2: loss" in printed and "--- sample" in printed  # the evaluation, then the export's samples
    assert not run.exists() and not scratch_dir(run).exists()
    assert result.final_dir is None and result.checkpoint is None


def test_a_bug_met_at_the_first_checkpoint_is_met_in_seconds_and_the_real_run_is_untouched(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="cannot save alongside step_00000001"):
        fast([f"run.out_dir={run}", "log.progress_bar=false", callback_override("testing_callbacks:FailsOnSave")], 1)
    assert [p.name for p in run.iterdir()] == ["notes.txt"]
    assert (scratch_dir(run) / "train.log").exists()  # what the failed check printed, kept
    assert fast([f"run.out_dir={run}", "log.progress_bar=false"], 1).steps == 1  # the next check replaces it
    assert not scratch_dir(run).exists()


def test_a_fast_dev_run_does_not_resume(tmp_path):
    with pytest.raises(RecipeError, match="^--fast-dev-run checks a run from its start"):
        fast([f"run.out_dir={tmp_path / 'run'}"], 1, resume="latest")
    with pytest.raises(RecipeError, match="^--fast-dev-run 0: expected a number of optimizer steps, 1 or more$"):
        fast([f"run.out_dir={tmp_path / 'run'}"], 0)


def test_a_bare_flag_is_one_step_and_a_number_after_it_is_its_value():
    assert bare_fast_dev_run(["train", "r.yaml", "--fast-dev-run"]) == ["train", "r.yaml", "--fast-dev-run=1"]
    assert bare_fast_dev_run(["train", "--fast-dev-run", "r.yaml"]) == ["train", "--fast-dev-run=1", "r.yaml"]
    assert bare_fast_dev_run(["train", "--fast-dev-run", "--set", "a=1"])[1] == "--fast-dev-run=1"
    assert bare_fast_dev_run(["train", "r.yaml", "--fast-dev-run", "4"])[2:] == ["--fast-dev-run", "4"]


@pytest.mark.slow
def test_cli_fast_dev_run_says_what_passed_in_its_last_line(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("train", TINY, "--fast-dev-run", *sets(f"run.out_dir={run}", "log.progress_bar=false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("fast dev run passed in ") and last.endswith(
        "s: 1 optimizer step, an evaluation (" + last.split("an evaluation (")[1].split(")")[0] + "), a checkpoint "
        "and the export; the scratch run directory is deleted")
    assert "loss " in last and not run.exists() and not scratch_dir(run).exists()
    proc = run_cli("train", TINY, "--fast-dev-run", "--resume", *sets(f"run.out_dir={run}"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "does not resume" in proc.stderr
