"""More evaluation sets (`data.eval_sets`): every evaluation scores each by name as the validation set is scored, its
metrics `<name>/<metric>` on the console, in the trackers, in `checkpoint.best_metric` and `s4accel eval`; a mistake
in one is one line before any compute."""

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY, read_metrics, recipe_error, run_cli, sets, small_text_file, train_in_process

DIGITS = Path(__file__).resolve().parents[1] / "recipes" / "digits.yaml"


@pytest.fixture(scope="module")
def texts(tmp_path_factory, hf_cache):
    """The opening of a play, and the same characters reversed (another text of the same alphabet)."""
    folder = tmp_path_factory.mktemp("texts")
    play = small_text_file(folder)
    other = folder / "other.txt"
    other.write_text(play.read_text()[::-1])
    return play, other


def lm(out, play, *extra):
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{play}]", "data.seq_len=32",
            "data.batch_size=4", "train.max_steps=4", "train.eval_every=2", "log.progress_bar=false",
            "sample.prompts=[]", "checkpoint.every_steps=0", *extra]


def test_an_eval_set_is_scored_exactly_as_the_validation_set_and_logged_under_its_name(tmp_path, texts, capsys):
    """A set holding the validation files scores the validation set's numbers to the last digit; another text scores
    its own; both at every evaluation, in metrics.jsonl as `eval/<name>/<metric>` and on the console after their
    name. The run's first line counts them."""
    play, other = texts
    result = train_in_process(TINY, lm(tmp_path / "run", play, f"data.val_files=[{play}]",
                                       f"data.eval_sets={{again: {{files: [{play}]}}, other: {{files: [{other}]}}}}"))
    m = result.eval_metrics
    for name in ("loss", "ppl", "bits_per_byte"):
        assert m[f"again/{name}"] == m[name]
    assert m["other/loss"] != m["loss"] and np.isfinite(m["other/loss"])
    evals = [r for r in read_metrics(result.run_dir) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["eval/again/loss"] == r["eval/loss"] and "eval/other/bits_per_char" in r for r in evals)
    out = capsys.readouterr().out
    assert "+ 2 eval sets (again 93, other 93 examples)" in out
    assert f"step 4: loss {m['loss']:.4f}" in out and f"| other: loss {m['other/loss']:.4f}, ppl" in out


def test_best_checkpoint_and_early_stopping_can_follow_an_eval_set(tmp_path, texts):
    """`checkpoint.best_metric: other/loss` keeps the step where that set scored best, with that number; early stopping
    may watch the EMA weights' score on it; a name of a set the recipe lacks is one line naming the sets, before any
    compute."""
    play, other = texts
    result = train_in_process(TINY, lm(tmp_path / "run", play, f"data.eval_sets={{other: {{files: [{other}]}}}}",
                                       "train.max_steps=6", "checkpoint.keep_best=1",
                                       "checkpoint.best_metric=other/loss",
                                       "train.early_stopping={metric: ema_other/loss, patience: 5}",
                                       "train.ema={decay: 0.9}"))
    evals = [r for r in read_metrics(result.run_dir) if "eval/other/loss" in r]
    assert all("eval_ema/other/loss" in r and "eval_ema/loss" in r for r in evals)  # the EMA weights' too
    best = min(evals, key=lambda r: r["eval/other/loss"])
    assert result.best[1:] == (best["step"], "other/loss", best["eval/other/loss"])
    proc = run_cli("train", TINY, *sets(*lm(tmp_path / "bad", play, f"data.eval_sets={{other: {{files: [{other}]}}}}",
                                            "checkpoint.keep_best=1", "checkpoint.best_metric=news/loss")))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
    assert "checkpoint.best_metric: 'news/loss' names an evaluation set 'news' the run does not have; its sets are " \
           "other" in proc.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("value, message", [
    ("{news: {}}", "data.eval_sets.news: give files (a non-empty list) or split, one of the two"),
    ("{news: {files: [a.txt], split: test}}", "give files (a non-empty list) or split, one of the two"),
    ("{'a/b': {files: [a.txt]}}", "data.eval_sets.a/b: a set's name is letters, digits"),
    ("{ema_x: {files: [a.txt]}}", "data.eval_sets.ema_x: the name 'ema_x' would read as another metric's"),
    ("{test: {split: test}}", "data.eval_sets.test: split names a split of a single `source: dataset`"),
    ("{news: {fils: [a.txt]}}", "data.eval_sets.news.fils: unknown key (did you mean 'files'?); allowed: files, "
                                "split"),
])
def test_a_mistake_in_an_eval_set_is_one_line_naming_it(value, message):
    assert message in recipe_error([f"data.eval_sets={value}"])


def test_eval_sets_of_sources_with_their_own_data_take_splits_only():
    for source, value, message in (
            ("digits", "{x: {files: [a.npz]}}", "data.source 'digits' has no other data to evaluate on"),
            ("lra_listops", "{x: {files: [a.tsv]}}", "data.source 'lra_listops' has its own splits: give split"),
            ("lra_listops", "{x: {split: dev}}", "LRA splits are train, val, test, not 'dev'")):
        extra = ["data.path=lra", "data.tokenizer=listops"] if source.startswith("lra") else []
        assert message in recipe_error([f"data.source={source}", *extra, f"data.eval_sets={value}"])


def test_an_eval_set_file_is_found_next_to_the_recipe(tmp_path, texts):
    """As `data.files`: a relative path in a recipe file means the file beside the recipe, from any directory."""
    import yaml

    from s4accel.config import load_recipe

    play, other = texts
    (tmp_path / "news.txt").write_text(other.read_text())
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"data": {"source": "files", "files": [str(play)],
                                                              "eval_sets": {"news": {"files": ["news.txt"]}}}}))
    recipe = load_recipe(tmp_path / "r.yaml")
    assert recipe.data.eval_sets["news"].files == [str(tmp_path / "news.txt")]


def test_labelled_documents_eval_set_reports_classifier_metrics_and_refuses_an_unseen_label(tmp_path, hf_cache):
    import csv

    text = "To be, or not to be, that is the question. Whether tis nobler in the mind to suffer. "

    def write(name, labels):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows([text[i:] + text[:i], label] for i, label in enumerate(labels))
        return tmp_path / name

    train = write("train.csv", "ab" * 8)
    same = write("same.csv", "ab" * 3)
    clf = lambda out, *extra: [  # noqa: E731
        f"run.out_dir={out}", "data.source=files", f"data.files=[{train}]", "data.label_field=label",
        f"data.val_files=[{same}]", "data.seq_len=64", "data.batch_size=4", "train.max_steps=2",
        "train.eval_every=0", "log.progress_bar=false", "sample.prompts=[]", "task.target=classification", *extra]
    result = train_in_process(TINY, clf(tmp_path / "run", f"data.eval_sets={{same: {{files: [{same}]}}}}"))
    m = result.eval_metrics
    assert {k: v for k, v in m.items() if k.startswith("same/")} == {f"same/{k}": v for k, v in m.items()
                                                                     if "/" not in k or k.startswith("precision/")
                                                                     or k.startswith("recall/")}
    odd = write("odd.csv", "abc")
    proc = run_cli("train", TINY, *sets(*clf(tmp_path / "bad", f"data.eval_sets={{odd: {{files: [{odd}]}}}}")))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "data.label_field: data.eval_sets.odd has label(s) the training set lacks: c" in proc.stderr


def test_arrays_eval_set_is_scored_with_the_training_classes_and_checked_against_their_shape(tmp_path, hf_cache):
    """`source: arrays`: an eval set holding the test split's sequences scores as the test split; one of another
    length, or with a class the training data lacks, is one line."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 12, 2)), np.array(["cat", "dog"] * 20)
    x_te, y_te = rng.normal(size=(10, 12, 2)), np.array(["dog", "cat"] * 5)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=x_te, y_test=y_te)
    np.savez(tmp_path / "same.npz", x=x_te, y=y_te)
    run = lambda out, value: [f"run.out_dir={out}", "data.source=arrays", f"data.files=[{tmp_path / 'd.npz'}]",  # noqa: E731
                              "model.overrides={d_model: 16, n_layer: 1, d_state: 8}", "train.max_steps=2",
                              "train.eval_every=0", "log.progress_bar=false", "checkpoint.every_steps=0",
                              "data.batch_size=8", f"data.eval_sets={value}"]
    result = train_in_process(DIGITS, run(tmp_path / "run", f"{{same: {{files: [{tmp_path / 'same.npz'}]}}}}"))
    m = result.eval_metrics
    assert (m["same/loss"], m["same/accuracy"], m["same/f1_macro"]) == (m["loss"], m["accuracy"], m["f1_macro"])
    np.savez(tmp_path / "short.npz", x=x_te[:, :8], y=y_te)
    np.savez(tmp_path / "bird.npz", x=x_te, y=np.array(["bird"] * 10))
    for name, message in (("short", "data.eval_sets.short: its sequences are (8, 2) (steps, features), the training "
                                    "split's (12, 2)"),
                          ("bird", "data.eval_sets.bird: label(s) the training split lacks: bird")):
        value = f"{{{name}: {{files: [{tmp_path / name}.npz]}}}}"
        proc = run_cli("train", DIGITS, *sets(*run(tmp_path / name, value)))
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_streamed_training_scores_its_eval_sets_too(tmp_path, texts):
    play, other = texts
    result = train_in_process(TINY, lm(tmp_path / "run", play, "data.streaming=true", f"data.val_files=[{play}]",
                                       f"data.eval_sets={{other: {{files: [{other}]}}}}"))
    assert np.isfinite(result.eval_metrics["other/loss"]) and result.eval_metrics["other/loss"] != \
        result.eval_metrics["loss"]


def test_s4accel_eval_scores_the_eval_sets_and_data_alone_with_data(tmp_path, texts):
    """`s4accel eval RUN RECIPE` scores the validation split and each eval set whole, as the run's last evaluation
    did uncapped; `--data FILE` scores that file alone."""
    play, other = texts
    result = train_in_process(TINY, lm(tmp_path / "run", play, f"data.eval_sets={{other: {{files: [{other}]}}}}",
                                       "train.eval_max_batches=null"))
    proc = run_cli("eval", result.run_dir, result.run_dir, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    scored = json.loads(proc.stdout)
    assert scored["other/loss"] == pytest.approx(result.eval_metrics["other/loss"], rel=1e-6)
    assert scored["loss"] == pytest.approx(result.eval_metrics["loss"], rel=1e-6)
    proc = run_cli("eval", result.run_dir, result.run_dir, "--json", "--data", other)
    assert proc.returncode == 0, proc.stderr[-2000:]
    alone = json.loads(proc.stdout)
    assert not any("/" in k for k in alone) and alone["loss"] == pytest.approx(scored["other/loss"], rel=1e-6)


def test_headline_groups_each_eval_set_after_its_name():
    from s4accel.training.evaluate import headline

    metrics = {"loss": 2.0, "accuracy": 0.5, "precision/cat": 0.25, "ema_loss": 1.5, "news/loss": 3.0,
               "news/accuracy": 0.75, "news/precision/cat": 0.5, "ema_news/loss": 2.5, "confusion": {"matrix": []},
               "steps": 3}
    assert headline(metrics) == ("loss 2.0000, accuracy 0.5000, ema_loss 1.5000, steps 3 | news: loss 3.0000, "
                                 "accuracy 0.7500, ema_loss 2.5000")


@pytest.mark.slow
def test_two_processes_score_an_eval_set_whole_once(tmp_path, texts):
    """93 blocks over 2 processes in batches of 4: the padded duplicates of the last batch are dropped from each set,
    so the run's last evaluation equals the final model's, scored in one process."""
    from helpers import FREE_PORT, REPO, accelerate_launch

    play, other = texts
    run_dir = tmp_path / "run"
    proc = accelerate_launch(*FREE_PORT, "--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml", "-m",
                             "s4accel", "train", TINY, *sets(*lm(run_dir, play, "train.eval_max_batches=null",
                                                                 f"data.eval_sets={{other: {{files: [{other}]}}}}")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = [r for r in read_metrics(run_dir) if "eval/other/loss" in r][-1]
    proc = run_cli("eval", run_dir, run_dir, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    scored = json.loads(proc.stdout)
    assert last["eval/other/loss"] == pytest.approx(scored["other/loss"], rel=1e-6)
    assert last["eval/loss"] == pytest.approx(scored["loss"], rel=1e-6)


def test_a_task_of_its_own_adds_an_eval_set_and_a_recipe_may_rank_by_it(tmp_path):
    """`TaskData.eval_sets` of a task of your own is scored like the recipe's sets; declared in `eval_set_names`, a
    recipe may keep the best checkpoint by it. The training set scored as a set is the mean of its squared errors."""
    import torch

    result = train_in_process(TINY, [f"run.out_dir={tmp_path / 'run'}", "task.target=testing_tasks:LineWithTrainSet",
                                     "train.max_steps=30", "train.eval_every=10", "data.batch_size=16",
                                     "optim.lr=0.05", "log.progress_bar=false", "checkpoint.every_steps=0",
                                     "checkpoint.keep_best=1", "checkpoint.best_metric=train/loss",
                                     "train.eval_max_batches=null", "sample.prompts=[]"])
    assert result.best[2] == "train/loss"
    from testing_tasks import LineWithTrainSet
    from safetensors.torch import load_file

    rows = LineWithTrainSet.build_data(None).eval_sets["train"]
    weights = load_file(result.final_dir / "model.safetensors")
    pred = torch.stack([r["x"] for r in rows]) @ weights["weight"].T + weights["bias"]
    mse = ((pred[:, 0] - torch.stack([r["y"] for r in rows])) ** 2).mean().item()
    assert result.eval_metrics["train/loss"] == pytest.approx(mse, rel=1e-5)


def test_a_model_card_reports_each_eval_set_on_its_own_split_or_files(tmp_path):
    """The card's results (the Hub's model-index) and table carry the eval sets' numbers beside the validation
    split's: another split of the source under that split's name, files under the set's name, named as the published
    recipe names them (no path of the training machine)."""
    from huggingface_hub import ModelCard

    from s4accel.tools.model_card import model_card

    recipe = {"data": {"source": "dataset", "path": "owner/reviews", "label_field": "label",
                       "eval_sets": {"test": {"split": "test"}, "news": {"files": [str(tmp_path / "news.csv")]}}}}
    metrics = {"step": 40, "loss": 0.5, "accuracy": 0.8, "precision/pos": 0.7, "test/accuracy": 0.75,
               "news/accuracy": 0.6, "news/precision/pos": 0.5}
    text = model_card("alice/clf", {"architectures": ["S4ForSequenceClassification"], "model_type": "s4accel-s4"},
                      recipe, "", [], metrics, "final", None, False)
    results = {(r.dataset_name, r.dataset_split, r.metric_type): r.metric_value
               for r in ModelCard(text).data.eval_results}
    assert results == {("owner/reviews", "validation", "loss"): 0.5, ("owner/reviews", "validation", "accuracy"): 0.8,
                       ("owner/reviews", "test", "test/accuracy"): 0.75,
                       ("local files: news.csv", "news", "news/accuracy"): 0.6}
    assert "| accuracy (test) (`test/accuracy`) | 0.7500 |" in text.replace("Accuracy", "accuracy")
    assert str(tmp_path) not in text


def test_a_run_resumes_with_eval_sets_added_or_removed(texts):
    """Evaluation sets change nothing training computes: a checkpoint's recipe without them (or with others) is the
    same run."""
    from s4accel.config import load_recipe
    from s4accel.training.runs.resume import recipe_diff

    play, other = texts
    before = load_recipe(TINY, [f"data.files=[{play}]", "data.source=files"]).to_dict()
    after = load_recipe(TINY, [f"data.files=[{play}]", "data.source=files",
                               f"data.eval_sets={{other: {{files: [{other}]}}}}"]).to_dict()
    assert recipe_diff(before, after) == [] and recipe_diff(after, before) == []
