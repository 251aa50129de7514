"""`data.max_train_examples`: training on a seeded random subset of the training set, the evaluation sets whole."""

import pytest

from helpers import TINY, read_metrics, recipe_error, train_in_process

DIGITS = TINY.parent / "digits.yaml"


def built_train(overrides, recipe=DIGITS):
    """The training set and the units the run's first line counts, as `build_run` hands them to the loop."""
    from helpers import recipe_accelerator
    from s4accel.config import load_recipe
    from s4accel.training.setup import build_run

    run = build_run(load_recipe(recipe, overrides), recipe_accelerator(overrides, recipe), None, optimizers=False)
    return run.context.data, run.plan


def test_a_run_trains_on_a_seeded_subset_of_its_examples_and_evaluates_the_whole_split(tmp_path, hf_cache):
    """100 of the digits' 1,438 training sequences: the same 100 for the same seed, others for another, an epoch of
    100 // batch_size steps; the validation split untouched."""
    whole, _ = built_train([])
    data, plan = built_train(["data.max_train_examples=100", "train.max_epochs=1", "train.max_steps=null"])
    again, _ = built_train(["data.max_train_examples=100"])
    other, _ = built_train(["data.max_train_examples=100", "run.seed=1"])
    rows = lambda d: [tuple(x.flatten().tolist()) for x in d.train[:]["input_values"]]  # noqa: E731
    assert len(data.train) == 100 and set(rows(data)) <= set(rows(whole)) and rows(data) == rows(again)
    assert rows(other) != rows(data) and len(data.val) == len(whole.val)
    assert plan.total_steps == 100 // 32
    assert data.n_train == round(whole.n_train * 100 / len(whole.train))


def test_a_language_model_counts_the_subset_in_its_first_line(tmp_path, text, capsys):
    result = train_in_process(TINY, [f"run.out_dir={tmp_path / 'r'}", "data.source=files", f"data.files=[{text}]",
                                     "data.seq_len=32", "data.batch_size=4", "data.max_train_examples=8",
                                     "train.max_epochs=2", "train.max_steps=null", "log.progress_bar=false",
                                     "sample.prompts=[]", "train.eval_every=0", "checkpoint.every_steps=0"])
    assert "256 train / " in capsys.readouterr().out  # 8 blocks of 32 tokens
    assert result.steps == 4 and [r["step"] for r in read_metrics(result.run_dir) if "eval/loss" in r] == [4]


@pytest.mark.parametrize("overrides, message", [
    (["data.max_train_examples=10", "data.streaming=true"], "data.max_train_examples draws from a map-style"),
    (["data.max_train_examples=10", "train.state.mode=reset"], "data.max_train_examples draws examples at random"),
    (["data.max_train_examples=0"], "data.max_train_examples: Input should be greater than or equal to 1"),
])
def test_max_train_examples_mistakes_are_one_line(overrides, message):
    assert message in recipe_error(["data.source=files", "data.files=[x.txt]", *overrides])
