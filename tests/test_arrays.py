"""Array data (features per step, one label per sequence) and sequence classification/regression through the loop."""

import numpy as np
import pytest
import torch

from helpers import REPO, read_metrics, train_in_process
from s4accel.data.arrays import build_array_data, parse_ts, read_ucr
from s4accel.config import DataCfg
from s4accel.errors import DataError

DIGITS = REPO / "recipes" / "digits.yaml"


def test_parse_ts_reads_multivariate_series_and_declared_classes(tmp_path):
    path = tmp_path / "toy.ts"
    path.write_text("# comment\n@problemName toy\n@univariate false\n@classLabel true up down\n@data\n"
                    "1,2,3:4,5,6:up\n7,8,9:1,1,1:down\n")
    x, labels, classes = parse_ts(path)
    assert x.shape == (2, 3, 2)  # (n, L, d)
    np.testing.assert_array_equal(x[0, :, 1], [4, 5, 6])
    assert labels == ["up", "down"] and classes == ["up", "down"]


def test_parse_ts_refuses_ragged_series(tmp_path):
    path = tmp_path / "ragged.ts"
    path.write_text("@classLabel true a b\n@data\n1,2,3:a\n1,2:b\n")
    with pytest.raises(DataError, match="different lengths"):
        parse_ts(path)


def test_ucr_sets_come_with_the_archive_split():
    x_tr, y_tr, x_te, _, classes = read_ucr("GunPoint")
    assert x_tr.shape == (50, 150, 1) and x_te.shape == (150, 150, 1)
    assert classes == ["1", "2"] and set(y_tr) == {0, 1}
    x_tr, *_ = read_ucr("ACSF1")
    assert x_tr.shape[1] == 1460
    with pytest.raises(DataError, match="available: .*GunPoint"):
        read_ucr("GunPointt")


def test_digits_split_is_seeded_and_normalised_with_train_statistics():
    cfg = DataCfg(source="digits", val_fraction=0.2)
    data = build_array_data(cfg)
    assert (len(data.train), len(data.val), data.d_input, data.num_labels, data.seq_len) == (1438, 359, 1, 10, 64)
    x = data.train[:]["input_values"]  # raw pixels: the model standardises them with the statistics it carries
    assert x.shape == (1438, 64, 1) and x.dtype == torch.float32
    x = (x - torch.tensor(data.input_mean)) / torch.tensor(data.input_std)
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 1e-2
    assert torch.equal(build_array_data(cfg).val[:]["labels"], data.val[:]["labels"])  # same split every time
    assert not torch.equal(build_array_data(DataCfg(source="digits", val_fraction=0.2, split_seed=1)).val[:]["labels"],
                           data.val[:]["labels"])


def test_user_npz_and_csv_files(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(20, 12, 3)), y=np.array(["cat", "dog"] * 10),
             x_test=rng.normal(size=(6, 12, 3)), y_test=np.array(["dog"] * 6))
    data = build_array_data(DataCfg(source="arrays", files=[str(tmp_path / "d.npz")]))
    assert (len(data.train), len(data.val), data.d_input, data.class_names) == (20, 6, 3, ["cat", "dog"])
    assert data.val[:]["labels"].tolist() == [1] * 6
    np.savetxt(tmp_path / "r.csv", np.column_stack([rng.normal(size=30), rng.normal(size=(30, 8))]), delimiter=",")
    reg = build_array_data(DataCfg(source="arrays", files=[str(tmp_path / "r.csv")], task="regression",
                                   val_fraction=0.2))
    assert (len(reg.train), len(reg.val), reg.num_labels, reg.seq_len) == (24, 6, 1, 8)
    assert reg.train[:]["labels"].dtype == torch.float32


def test_user_files_are_never_unpickled(tmp_path):
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with pytest.raises(ValueError, match="holds Python objects; s4accel never unpickles data files"):
        build_array_data(DataCfg(source="arrays", files=[str(tmp_path / "obj.npz")]))


def test_recipe_refuses_prompts_for_a_classifier_and_ucr_without_a_name():
    from s4accel.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="sample.prompts"):
        load_recipe(DIGITS, ["sample.prompts=[hi]"])
    with pytest.raises(RecipeError, match="ucr_name"):
        load_recipe(DIGITS, ["data.source=ucr"])
    with pytest.raises(RecipeError, match="set from the tokenizer or the data"):
        load_recipe(DIGITS, ["model.overrides={d_input: 3}"])


def test_classifier_trains_evaluates_and_exports(tmp_path, hf_cache):
    from transformers import AutoModelForSequenceClassification

    run_dir = tmp_path / "run"
    result = train_in_process(DIGITS, [f"run.out_dir={run_dir}", "model.overrides={d_model: 32, n_layer: 1, "
                                       "d_state: 16, bidirectional: true}", "train.max_steps=40",
                                       "train.eval_every=20", "log.log_every=10", "log.progress_bar=false",
                                       "checkpoint.every_steps=0", "train.grad_accum=2",
                                       "scheduler.warmup_steps=5", "optim.lr=1e-2"])
    per_class = {f"{m}/{k}" for m in ("precision", "recall") for k in range(10)}
    assert set(result.eval_metrics) == {"loss", "accuracy", "f1_macro", "confusion_matrix", *per_class}
    assert result.eval_metrics["accuracy"] > 0.3  # 10 classes: chance is 0.1
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [20, 40]
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "final").eval()
    assert model.config.id2label[3] == "3"
    # The exported model reproduces the loop's gathered accuracy on the same test split.
    data = build_array_data(DataCfg(source="digits", val_fraction=0.2))
    with torch.no_grad():
        logits = model(input_values=data.val[:]["input_values"]).logits
    hits = (logits.argmax(-1) == data.val[:]["labels"]).sum().item()
    assert hits / len(data.val) == pytest.approx(result.eval_metrics["accuracy"], abs=1e-12)


def test_regression_learns_a_target(tmp_path, hf_cache):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16, 1)).astype(np.float32)
    np.savez(tmp_path / "r.npz", x=x, y=x[:, :, 0].mean(1) * 3)  # target: 3 x the series' mean
    run_dir = tmp_path / "run"
    result = train_in_process(DIGITS, [f"run.out_dir={run_dir}", "data.source=arrays",
                                       f"data.files=[{tmp_path / 'r.npz'}]", "data.task=regression",
                                       "data.normalize=false", "model.overrides={d_model: 16, n_layer: 1, "
                                       "d_state: 8}", "train.max_steps=150", "train.eval_every=0",
                                       "log.progress_bar=false", "checkpoint.every_steps=0", "data.batch_size=16",
                                       "optim.lr=1e-2"])
    assert set(result.eval_metrics) == {"loss", "mse", "mae"}
    variance = float(np.var(x[:, :, 0].mean(1) * 3))  # what predicting the mean would score
    assert result.eval_metrics["mse"] < 0.3 * variance


def test_dtw_baseline_matches_the_textbook_recursion():
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from ucr_dtw_baseline import dtw_distances

    torch.manual_seed(0)
    a, b = torch.randn(3, 9, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64)

    def naive(x, y):
        D = torch.full((10, 10), float("inf"), dtype=torch.float64)
        D[0, 0] = 0
        for i in range(1, 10):
            for j in range(1, 10):
                D[i, j] = (x[i - 1] - y[j - 1]) ** 2 + min(D[i - 1, j], D[i, j - 1], D[i - 1, j - 1])
        return D[9, 9]

    expected = torch.tensor([[naive(x, y) for y in b] for x in a], dtype=torch.float64)
    torch.testing.assert_close(dtw_distances(a, b), expected, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, hf_cache):
    run_dir = tmp_path_factory.mktemp("digits") / "run"
    train_in_process(DIGITS, [f"run.out_dir={run_dir}", "model.overrides={d_model: 16, n_layer: 1, d_state: 8}",
                              "train.max_steps=2", "train.eval_every=0", "scheduler.warmup_steps=0",
                              "log.progress_bar=false", "checkpoint.every_steps=0"])
    return run_dir


def test_predict_on_arrays_of_another_width_than_the_model_was_trained_on_is_one_line(digits_run, tmp_path):
    """It was a matrix-multiplication RuntimeError traceback."""
    from s4accel.tools.predict import predict

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "wide.npz", x=rng.normal(size=(6, 64, 3)).astype(np.float32), y=np.arange(6))
    with pytest.raises(DataError, match=r"wide.npz: 3 feature\(s\) per step, but the model was trained on 1"):
        predict(digits_run, tmp_path / "wide.npz", tmp_path / "p.csv", progress=False)
    assert not (tmp_path / "p.csv").exists()
    np.savez(tmp_path / "ok.npz", x=rng.normal(size=(6, 64, 1)).astype(np.float32), y=np.arange(6))
    predict(digits_run, tmp_path / "ok.npz", tmp_path / "p.csv", progress=False)
    assert len((tmp_path / "p.csv").read_text().splitlines()) == 7  # header + one row per example


def test_predict_output_places_that_cannot_take_the_file_are_one_line_before_predicting(digits_run, tmp_path):
    """A folder as --out, a path under a file, an unwritable place: tracebacks after predicting, before."""
    from pathlib import Path

    from s4accel.tools.predict import predict

    np.savez(tmp_path / "ok.npz", x=np.zeros((4, 64, 1), np.float32), y=np.arange(4))
    (tmp_path / "folder.csv").mkdir()
    (tmp_path / "a_file").write_text("mine")
    for out, message in ((tmp_path / "folder.csv", r"folder.csv: is a folder; give a file path"),
                         (tmp_path / "a_file" / "p.csv", r"a_file is a file, not a folder"),
                         (Path("/proc/p.csv"), r"--out /proc/p.csv: cannot write there")):
        with pytest.raises(DataError, match=message):
            predict(digits_run, tmp_path / "ok.npz", out, progress=False)
    assert (tmp_path / "a_file").read_text() == "mine" and not any((tmp_path / "folder.csv").iterdir())
    (tmp_path / "p.jsonl").write_text("an older prediction\n")
    predict(digits_run, tmp_path / "ok.npz", tmp_path / "p.jsonl", progress=False)
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder.csv", "ok.npz", "p.jsonl"]  # no leftovers
