"""Evaluation metrics beyond loss and accuracy: a classifier's macro-F1, per-class precision and recall and confusion
matrix, computed on every sample's prediction gathered from all processes, logged to the trackers and reported by
`s4accel eval --json`; the recipe's own metric functions (`task.metrics`); `s4accel predict --keep` carrying input
columns through to its output so it can be scored without a join."""

import csv
import glob
import json

import pytest
import torch

from helpers import FREE_PORT, REPO, TESTS_ON_PATH, accelerate_launch, read_metrics, run_cli, sets, train_in_process

DIGITS = REPO / "recipes" / "digits.yaml"
BALANCED = '''
import torch


def balanced_accuracy(predictions, labels):
    """The mean over classes of each class's share of hits: macro recall."""
    return float(torch.stack([(predictions[labels == c] == c).double().mean() for c in labels.unique()]).mean())
'''


def digits(out, *extra):
    """The sequential digits classifier, small and short: 359 test images (not a multiple of the batch size, so the
    last batch of 2 processes is padded with duplicates)."""
    return [f"run.out_dir={out}", "model.overrides={d_model: 32, n_layer: 1, d_state: 8, bidirectional: true, "
            "pooling: mean}", "train.max_steps=20", "train.eval_every=10", "scheduler.warmup_steps=0", "optim.lr=1e-2",
            "log.progress_bar=false", *extra]


def test_macro_f1_precision_recall_and_confusion_on_a_case_worked_by_hand():
    from s4accel.training.observe.class_scores import classification_scores

    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    predictions = torch.tensor([0, 0, 1, 1, 2, 2])
    scores = classification_scores(predictions, labels, ["a", "b", "c", "d"])  # d: in neither
    assert scores["confusion_matrix"] == {"labels": ["a", "b", "c", "d"],
                                          "matrix": [[2, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]]}
    assert [scores[f"precision/{c}"] for c in "abcd"] == [1.0, 0.5, 0.5, 0.0]  # d is never predicted: 0
    assert [scores[f"recall/{c}"] for c in "abcd"] == pytest.approx([2 / 3, 0.5, 1.0, 0.0])
    # F1 per class: a 2 * 1 * 2/3 / (1 + 2/3) = 4/5, b 1/2, c 2 * 1/2 / (3/2) = 2/3; d occurs nowhere: not averaged
    assert scores["f1_macro"] == pytest.approx((4 / 5 + 1 / 2 + 2 / 3) / 3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits")
    (folder / "mymetrics.py").write_text(BALANCED)
    out = folder / "run"
    metrics = f"task.metrics=[{folder / 'mymetrics.py'}:balanced_accuracy, testing_metrics:errors]"
    train_in_process(DIGITS, digits(out, metrics))
    return out, digits(out, metrics)


def test_a_count_a_metric_function_returns_is_printed_as_a_count():
    """`errors: 74` read `errors 74.0000` on the console."""
    from s4accel.training.evaluate import headline
    from s4accel.training.observe.recipe_metrics import MetricFunction, recipe_metrics

    import testing_metrics

    values = {"prediction": torch.tensor([0, 1, 2, 2]), "label": torch.tensor([0, 1, 1, 0])}
    found = recipe_metrics([MetricFunction("testing_metrics:errors", "errors", testing_metrics.errors)], values, {})
    assert headline({"loss": 0.123456, **found}) == "loss 0.1235, errors 2, scored 4"


def test_a_classifier_logs_f1_per_class_scores_and_the_confusion_matrix_with_the_recipes_metrics(run):
    out, _ = run
    evals = [r for r in read_metrics(out) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    last = evals[-1]
    table = last["eval/confusion_matrix"].splitlines()  # text: TensorBoard's text panel renders the Markdown
    assert table[0] == "| true \\ predicted | " + " | ".join(map(str, range(10))) + " |" and len(table) == 12
    matrix = torch.tensor([[int(c) for c in row.strip("| ").split(" | ")[1:]] for row in table[2:]])
    assert matrix.sum() == 359  # every test image once
    assert last["eval/accuracy"] == pytest.approx(matrix.trace().item() / 359)
    recall = [last[f"eval/recall/{c}"] for c in range(10)]
    assert recall == pytest.approx((matrix.diagonal() / matrix.sum(1)).tolist())
    assert last["eval/balanced_accuracy"] == pytest.approx(sum(recall) / 10)  # the recipe's function: macro recall
    assert last["eval/errors"] == 359 - matrix.trace().item() and last["eval/scored"] == 359
    assert 0 < last["eval/f1_macro"] < 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(glob.glob(str(out / "tensorboard" / "**" / "events*"), recursive=True)[0])
    events.Reload()
    assert {"eval/f1_macro", "eval/precision/3", "eval/recall/9", "eval/balanced_accuracy"} <= set(
        events.Tags()["scalars"])
    assert events.Tags()["tensors"] == ["eval/confusion_matrix/text_summary"]


def test_eval_json_reports_the_same_scores_and_the_matrix(run):
    out, overrides = run
    proc = run_cli("eval", out, DIGITS, *sets(*overrides), "--json", env=TESTS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    last = [r for r in read_metrics(out) if "eval/loss" in r][-1]
    for key in ("loss", "accuracy", "f1_macro", "precision/0", "recall/7", "balanced_accuracy", "errors"):
        assert metrics[key] == pytest.approx(last[f"eval/{key}"], rel=1e-9), key
    confusion = metrics["confusion_matrix"]
    assert confusion["labels"] == [str(c) for c in range(10)] and sum(map(sum, confusion["matrix"])) == 359


def test_recipe_metric_functions_that_cannot_be_used_are_one_line_before_compute(tmp_path):
    from s4accel.config import load_recipe
    from s4accel.errors import RecipeError
    from s4accel.training.task import load_task

    (tmp_path / "m.py").write_text("def two(predictions, labels):\n    return 0.0\n\nnot_a_function = 3\n")
    bad = [("testing_metrics:one_argument", "task.metrics: testing_metrics:one_argument must take (predictions, "
                                            "labels); it takes (predictions)"),
           ("nosuchmodule:f", "task.metrics: cannot import 'nosuchmodule:f' (ModuleNotFoundError"),
           (f"{tmp_path / 'm.py'}:three", f"task.metrics: cannot import '{tmp_path / 'm.py'}:three' (AttributeError"),
           (f"{tmp_path / 'm.py'}:not_a_function", "is not a function"),
           ("m.py", "task.metrics: expected 'package.module:function' or 'path/file.py:function', got 'm.py'")]
    for target, message in bad:
        proc = run_cli("train", DIGITS, *sets(f"run.out_dir={tmp_path / 'r'}", f"task.metrics=[{target}]"),
                       env=TESTS_ON_PATH)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, (target, proc.stderr[-2000:])
        assert message in proc.stderr and not (tmp_path / "r").exists(), (target, proc.stderr)
    text = load_recipe(REPO / "recipes" / "s4_tiny_debug.yaml", [f"task.metrics=[{tmp_path / 'm.py'}:two]"])
    with pytest.raises(RecipeError, match="task.metrics: CausalLMTask gathers no per-sample predictions and labels"):
        load_task(text)
    # a metric a recipe ranks by may be a function's (a number, named after it); another name is still refused
    ranked = ["checkpoint.keep_best=1", "checkpoint.best_mode=max", f"task.metrics=[{tmp_path / 'm.py'}:two]"]
    load_task(load_recipe(DIGITS, [*ranked, "checkpoint.best_metric=two"]))
    with pytest.raises(RecipeError, match="reports no metric 'too'.*did you mean 'two'"):
        load_task(load_recipe(DIGITS, [*ranked, "checkpoint.best_metric=too"]))


def test_what_a_recipe_metric_function_returns_is_checked_at_the_first_evaluation(tmp_path):
    from s4accel.errors import RecipeError

    with pytest.raises(RecipeError, match=r"task.metrics: testing_metrics:returns_text returned 'not a number'; "
                                          r"expected a number, or a dict of numbers by name"):
        train_in_process(DIGITS, digits(tmp_path / "a", "train.max_steps=1",
                                        "task.metrics=[testing_metrics:returns_text]"))
    with pytest.raises(RecipeError, match="task.metrics: testing_metrics:errors reports 'errors', which is reported "
                                          "already"):
        train_in_process(DIGITS, digits(tmp_path / "b", "train.max_steps=1",
                                        "task.metrics=[testing_metrics:errors, testing_metrics:errors]"))
    result = train_in_process(DIGITS, digits(tmp_path / "c", "train.max_steps=1",
                                             "task.metrics=[testing_metrics:label_dtype]"))
    assert result.eval_metrics["label_dtype"] == 1.0  # class ids, as int64


@pytest.mark.slow
def test_eval_scores_are_the_same_on_one_and_two_processes(run):
    """Every sample counted once on 2 processes: the last batch's padding duplicates are dropped before the
    confusion matrix, F1 and the recipe's functions see the predictions. One process: the run's last evaluation."""
    from s4accel.training.observe.class_scores import confusion_text

    out, overrides = run
    two = accelerate_launch(*FREE_PORT, "--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml", "-m",
                            "s4accel", "eval", out, DIGITS, *sets(*overrides), "--json", env=TESTS_ON_PATH)
    assert two.returncode == 0, two.stderr[-3000:]
    metrics = json.loads(two.stdout.strip().splitlines()[-1])
    last = [r for r in read_metrics(out) if "eval/loss" in r][-1]
    one = {k.removeprefix("eval/"): v for k, v in last.items() if k.startswith("eval/")}
    assert confusion_text(metrics.pop("confusion_matrix")) == one.pop("confusion_matrix")
    assert metrics["scored"] == 359 and metrics == pytest.approx(one, rel=1e-9)


def test_predict_keeps_the_true_label_so_its_output_scores_like_eval_without_a_join(run, tmp_path):
    """The digits test split as a file: `--keep label` puts each image's true label beside the prediction, and the
    share of rows where they agree is the accuracy the run's evaluation reported."""
    import numpy as np

    from s4accel.config import load_recipe
    from s4accel.data import build_array_data

    out, overrides = run
    val = build_array_data(load_recipe(DIGITS, overrides).data).val[:]
    np.savez(tmp_path / "test.npz", x=val["input_values"].numpy(), y=val["labels"].numpy())
    proc = run_cli("predict", out, tmp_path / "test.npz", "--out", tmp_path / "p.jsonl", "--keep", "id,label")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert list(rows[0])[:3] == ["id", "label", "prediction"] and [r["id"] for r in rows] == list(range(359))
    assert [r["label"] for r in rows] == [str(int(y)) for y in val["labels"]]  # by name, as the predictions are
    last = [r for r in read_metrics(out) if "eval/loss" in r][-1]
    agree = sum(r["label"] == r["prediction"] for r in rows)
    assert agree / 359 == pytest.approx(last["eval/accuracy"]) and 359 - agree == last["eval/errors"]


def test_predict_keeps_any_columns_of_a_data_file_and_refuses_missing_ones_before_predicting(tmp_path):
    """Chosen columns of a CSV (an id, the true label, a column of one's own) come through in every row, in order;
    a column the file lacks, or one named like predict's own, is one line before any compute."""
    from helpers import TINY

    text = "To be, or not to be, that is the question. Whether tis nobler in the mind to suffer. "
    with open(tmp_path / "docs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "text", "label", "source"])
        writer.writerows([f"k{i}", text[i:] + text[:i], "ab"[i % 2], f"s{i * 7}"] for i in range(12))
    clf = ["data.source=files", f"data.files=[{tmp_path / 'docs.csv'}]", "data.label_field=label",
           "data.val_fraction=0.25", "data.seq_len=64", "data.batch_size=4", "train.max_steps=2", "train.eval_every=0",
           "scheduler.warmup_steps=0", "log.progress_bar=false", "sample.prompts=[]", "task.target=classification"]
    train_in_process(TINY, [f"run.out_dir={tmp_path / 'run'}", *clf])
    pred = tmp_path / "p.csv"
    proc = run_cli("predict", tmp_path / "run", tmp_path / "docs.csv", "--out", pred, "--keep", "key, label,source")
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(pred, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["id", "key", "label", "source", "prediction", "prob_a", "prob_b"]
    assert [(r["id"], r["key"], r["label"], r["source"]) for r in rows] == [
        (str(i), f"k{i}", "ab"[i % 2], f"s{i * 7}") for i in range(12)]  # no id column: the row number
    for keep, message in (("label,genre", "--keep: no column 'genre' in"), ("prediction", "--keep: 'prediction' is "
                                                                            "a column predict writes itself"),
                          ("id,,label", "expected column names separated by commas")):
        proc = run_cli("predict", tmp_path / "run", tmp_path / "docs.csv", "--out", tmp_path / "q.csv", "--keep", keep)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, (keep, proc.stderr[-2000:])
        assert message in proc.stderr and not (tmp_path / "q.csv").exists(), (keep, proc.stderr)


def test_a_run_resumes_with_metric_functions_added_even_from_a_recipe_that_predates_them():
    """Metrics change nothing a model computes: a checkpoint's recipe without `task.metrics` (written before the key
    existed) is the same run."""
    from s4accel.config import load_recipe
    from s4accel.training.runs.resume import recipe_diff

    old = load_recipe(DIGITS).to_dict()
    del old["task"]["metrics"]
    assert recipe_diff(old, load_recipe(DIGITS, ["task.metrics=[testing_metrics:errors]"]).to_dict()) == []


def test_a_best_metric_that_is_not_a_number_is_said_not_silently_unranked(tmp_path):
    """`checkpoint.best_metric` from a function returning NaN, `keep_best: 2`: no best/ at all, and no line."""
    proc = run_cli("train", DIGITS, *sets(*digits(tmp_path / "r", "train.max_steps=2", "train.eval_every=1",
                                                  "task.metrics=[testing_metrics:not_a_number]",
                                                  "checkpoint.keep_best=2", "checkpoint.best_metric=not_a_number")),
                   env=TESTS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("warning:") and "not_a_number" in line]
    assert said == ["warning: step 1: checkpoint.best_metric not_a_number is nan; this model is not ranked among the "
                    "best", "warning: step 2: checkpoint.best_metric not_a_number is nan; this model is not ranked "
                    "among the best"], proc.stdout


def test_a_metric_function_that_raises_is_one_line_and_the_trained_model_is_kept(tmp_path):
    """A traceback after training, exit 1, and no final/: the run's export lost to a metric."""
    out = tmp_path / "r"
    proc = run_cli("train", DIGITS, *sets(*digits(out, "train.max_steps=2", "train.eval_every=0",
                                                  "task.metrics=[testing_metrics:raises]")), env=TESTS_ON_PATH)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    said = [line for line in proc.stdout.splitlines() if "testing_metrics:raises" in line]
    assert said == ["warning: task.metrics: testing_metrics:raises raised ZeroDivisionError (division by zero); "
                    "raises is nan this time"], proc.stdout
    assert (out / "final" / "model.safetensors").is_file()
