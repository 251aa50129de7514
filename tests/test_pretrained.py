"""Start from a pretrained model and use a trained model on new data: continued pretraining, a classifier head on a
language model's backbone, state hooks, frozen parameters, predict and eval on 1 and 2 processes, the preprocessing
that travels with a model."""

import csv
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import FREE_PORT, REPO, TINY, accelerate_launch, final_weights, read_metrics, run_cli, train_in_process
from s4accel.errors import RecipeError

pytestmark = pytest.mark.slow


def lm(text, out, *extra):
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4",
            "data.val_fraction=0.2", "train.eval_every=0", "scheduler.warmup_steps=0", "log.progress_bar=false",
            "log.log_every=1",
            "log.log_with=[jsonl]", "sample.prompts=[]", *extra]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, text):
    """A tiny language model trained for 60 steps on the play."""
    out = tmp_path_factory.mktemp("pre") / "run"
    train_in_process(TINY, lm(text, out, "train.max_steps=60"))
    return out


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """Labelled documents: scenes of two plays, labelled by play, as CSV (with ids) train and test files."""
    from s4accel.data.sources import shakespeare

    folder = tmp_path_factory.mktemp("scenes")
    rows = shakespeare("scenes")
    keep = [i for i, t in enumerate(rows["title"]) if t in ("hamlet", "twelfth night")]
    rows = rows.select(keep).add_column("id", [f"s{i}" for i in range(len(keep))])
    test = rows.select(range(0, len(rows), 4))
    train = rows.select([i for i in range(len(rows)) if i % 4])
    train.to_csv(str(folder / "train.csv"), index=False)
    test.to_csv(str(folder / "test.csv"), index=False)
    return folder


def classifier(scenes, out, *extra):
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{scenes / 'train.csv'}]",
            "data.label_field=title",
            f"data.val_files=[{scenes / 'test.csv'}]", "data.seq_len=128", "data.batch_size=4",
            "train.eval_every=0", "scheduler.warmup_steps=0", "log.progress_bar=false", "log.log_with=[jsonl]",
            "sample.prompts=[]", "task.target=classification", *extra]


def test_continued_pretraining_beats_training_from_scratch_on_the_same_budget(pretrained, text, tmp_path):
    budget = ["train.max_steps=10"]
    cont = train_in_process(TINY, lm(text, tmp_path / "cont", *budget, f"model={{pretrained: {pretrained}}}"))
    scratch = train_in_process(TINY, lm(text, tmp_path / "scratch", *budget))
    assert cont.eval_metrics["loss"] < scratch.eval_metrics["loss"] - 0.3
    assert [r["step"] for r in read_metrics(tmp_path / "cont") if "train/loss" in r][0] == 1  # step 0, fresh start


def test_a_language_models_backbone_starts_a_classifier_with_a_new_head(pretrained, scenes, tmp_path, capsys):
    tiny_lr = ["optim.lr=1e-12", "optim.ssm_lr=1e-12", "optim.weight_decay=0"]
    result = train_in_process(TINY, classifier(scenes, tmp_path / "clf", "train.max_steps=1", *tiny_lr,
                                               f"model={{pretrained: {pretrained}}}"))
    out = capsys.readouterr().out
    assert f"model.pretrained {pretrained}: " in out and "new: score.weight, score.bias" in out
    lm_w, clf_w = final_weights(pretrained), final_weights(tmp_path / "clf")
    backbone = [k for k in clf_w if k.startswith("backbone.")]
    assert backbone and set(backbone) == {k for k in lm_w if k.startswith("backbone.")}
    for k in backbone:  # one step at lr 1e-12 moves nothing measurable: the values are the language model's
        torch.testing.assert_close(clf_w[k], lm_w[k], rtol=0, atol=1e-9)
    assert result.final_dir is not None


def test_a_mismatched_checkpoint_is_one_line_and_a_state_hook_makes_it_load(pretrained, text, tmp_path):
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in (pretrained / "final").iterdir():
        if f.name != "model.safetensors":
            (renamed / f.name).write_bytes(f.read_bytes())
    tensors = load_file(pretrained / "final" / "model.safetensors")
    save_file({k.replace("backbone.", "encoder_stack."): v for k, v in tensors.items()}, renamed / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(RecipeError, match=r"model.pretrained: \d+ parameter\(s\) would start untrained: "
                                          r"backbone\.embeddings\.weight"):
        train_in_process(TINY, lm(text, tmp_path / "a", "train.max_steps=1", f"model={{pretrained: {renamed}}}"))
    assert not (tmp_path / "a").exists()  # refused before anything was written
    (tmp_path / "hooks.py").write_text(
        "def rename(state, model):\n"
        "    return {k.replace('encoder_stack.', 'backbone.'): v for k, v in state.items()}\n")
    train_in_process(TINY, lm(text, tmp_path / "b", "train.max_steps=1", "optim.lr=1e-12",
                              f"model={{pretrained: {renamed}, state_hook: '{tmp_path / 'hooks.py'}:rename'}}"))
    torch.testing.assert_close(final_weights(tmp_path / "b")["backbone.embeddings.weight"],
                               tensors["backbone.embeddings.weight"], rtol=0, atol=1e-9)


def test_setting_pretrained_on_a_recipe_that_names_a_size_needs_nothing_else(pretrained, text, tmp_path):
    """The pretrained config wins over the recipe's model.name (which was refused: a second --set was needed); an
    override that would change the weights' meaning is what gets refused."""
    result = train_in_process(TINY, lm(text, tmp_path / "a", "train.max_steps=1", f"model.pretrained={pretrained}"))
    assert result.steps == 1
    from s4accel.config import load_recipe

    assert load_recipe(TINY, [f"model.pretrained={pretrained}"]).model.name is None
    with pytest.raises(RecipeError, match=r"model.overrides.d_model: cannot change a pretrained model's d_model"):
        train_in_process(TINY, lm(text, tmp_path / "b", "train.max_steps=1", f"model.pretrained={pretrained}",
                                  "model.overrides={d_model: 48}"))


def test_overrides_that_would_invalidate_the_weights_are_refused(pretrained, text, tmp_path):
    with pytest.raises(RecipeError, match=r"model.overrides.d_model: cannot change a pretrained model's d_model"):
        train_in_process(TINY, lm(text, tmp_path / "a", "train.max_steps=1",
                                  f"model={{pretrained: {pretrained}, overrides: {{d_model: 32}}}}"))
    with pytest.raises(RecipeError, match=r"trained with vocab_size=259 but this data gives 300"):
        train_in_process(TINY, lm(text, tmp_path / "b", "train.max_steps=1", "data.tokenizer=bpe",
                                  "data.vocab_size=300", f"model={{pretrained: {pretrained}}}"))


def test_a_pretrained_model_with_nan_or_inf_weights_is_one_line_before_training(pretrained, text, tmp_path):
    """Loaded unchecked, the run stopped at its first step blaming optim.lr."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (pretrained / "final").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    tensors["backbone.embeddings.weight"][3, :2] = torch.tensor([float("nan"), float("inf")])
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RecipeError, match=r"model.pretrained: .*broken: backbone.embeddings.weight holds 2 NaN or "
                                          r"infinite value\(s\) of \d+; not weights to start from"):
        train_in_process(TINY, lm(text, tmp_path / "a", "train.max_steps=1", f"model={{pretrained: {broken}}}"))
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("hook, message", [
    ("return {k: 1 for k in state}", r"must map parameter names to tensors; 'backbone.*' maps to int"),
    ("return {k: v.tolist() for k, v in state.items()}", r"must map parameter names to tensors; .* maps to list"),
])
def test_a_state_hook_returning_other_than_tensors_is_one_line(pretrained, text, tmp_path, hook, message):
    name = f"hooks_{abs(hash(hook))}.py"  # a module per hook: a file imported once stays imported
    (tmp_path / name).write_text(f"def hook(state, model):\n    {hook}\n")
    with pytest.raises(RecipeError, match=rf"model.state_hook: .*{name}:hook " + message):
        train_in_process(TINY, lm(text, tmp_path / "a", "train.max_steps=1",
                                  f"model={{pretrained: {pretrained}, state_hook: '{tmp_path / name}:hook'}}"))


def test_freezing_every_parameter_is_one_line(pretrained, text, tmp_path):
    with pytest.raises(RecipeError, match=r"model.freeze: \['\*'\] fixes every parameter: nothing would train"):
        train_in_process(TINY, lm(text, tmp_path / "a", "train.max_steps=1",
                                  f"model={{pretrained: {pretrained}, freeze: ['*']}}"))


def test_frozen_parameters_stay_bit_identical(pretrained, scenes, tmp_path):
    train_in_process(TINY, classifier(scenes, tmp_path / "frozen", "train.max_steps=5", "optim.lr=1e-2",
                                      f"model={{pretrained: {pretrained}, freeze: ['backbone.*']}}"))
    lm_w, clf_w = final_weights(pretrained), final_weights(tmp_path / "frozen")
    assert all(torch.equal(clf_w[k], lm_w[k]) for k in clf_w if k.startswith("backbone."))
    assert not torch.equal(clf_w["score.weight"], torch.zeros_like(clf_w["score.weight"]))


@pytest.fixture(scope="module")
def trained_classifier(pretrained, scenes, tmp_path_factory):
    out = tmp_path_factory.mktemp("clf") / "run"
    train_in_process(TINY, classifier(scenes, out, "train.max_steps=20", f"model={{pretrained: {pretrained}}}"))
    return out


def own_forward(model_dir, texts, seq_len=128):
    from s4accel.tools.inference import load_model

    model, tok, _ = load_model(model_dir)
    probs = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"][:seq_len]])
            probs.append(torch.softmax(model(input_ids=ids).logits.double(), -1)[0])
    return torch.stack(probs), [model.config.id2label[i] for i in range(model.config.num_labels)]


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


LAUNCH = [*FREE_PORT, "--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml", "-m", "s4accel"]


@pytest.mark.parametrize("processes", [1, 2])
def test_predict_equals_the_models_own_forward_in_order_with_ids(trained_classifier, scenes, tmp_path, processes):
    out = tmp_path / "pred.csv"
    args = ["predict", trained_classifier, scenes / "test.csv", "--out", out, "--batch-size", "3"]
    if processes == 1:
        proc = run_cli(*args)
    else:
        proc = accelerate_launch(*LAUNCH, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(out)
    import datasets

    test = datasets.load_dataset("csv", data_files=str(scenes / "test.csv"), split="train")
    assert [r["id"] for r in rows] == list(test["id"])  # every example once, in order: no padded duplicates
    probs, names = own_forward(trained_classifier / "final", list(test["text"]))
    got = torch.tensor([[float(r[f"prob_{n}"]) for n in names] for r in rows], dtype=torch.float64)
    torch.testing.assert_close(got, probs, rtol=1e-5, atol=1e-6)
    assert [r["prediction"] for r in rows] == [names[i] for i in probs.argmax(1).tolist()]


def test_eval_scores_a_whole_file_the_same_on_one_and_two_processes(trained_classifier, scenes, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((trained_classifier / "recipe.yaml").read_text())
    common = ["eval", trained_classifier, recipe, "--set", "train.eval_max_batches=1", "--set", "data.batch_size=2",
              "--data", scenes / "test.csv", "--json"]
    one = run_cli(*common)
    two = accelerate_launch(*LAUNCH, *common)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    m1, m2 = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (one, two))
    assert m1.pop("confusion_matrix") == m2.pop("confusion_matrix")  # the same counts, whole
    assert m1 == pytest.approx(m2, rel=1e-9)
    rows = read_rows(scenes / "test.csv")
    probs, names = own_forward(trained_classifier / "final", [r["text"] for r in rows])
    hits = [names[i] == r["title"] for i, r in zip(probs.argmax(1).tolist(), rows)]
    assert m1["accuracy"] == pytest.approx(sum(hits) / len(hits))  # the whole file, not eval_max_batches of it


def test_eval_runs_a_task_of_your_own(tmp_path):
    out = tmp_path / "run"
    diabetes = REPO / "examples" / "diabetes.yaml"
    task = f"task.target={REPO / 'examples' / 'diabetes_regression.py'}:DiabetesRegression"
    proc = run_cli("train", diabetes, "--set", task, "--set", f"run.out_dir={out}", "--set", "train.max_steps=40",
                   "--set", "log.progress_bar=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    trained = [r for r in read_metrics(out) if "eval/r2" in r][-1]
    proc = run_cli("eval", out, diabetes, "--set", task, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["r2"] == pytest.approx(trained["eval/r2"], rel=1e-6)


def test_input_statistics_travel_with_the_model(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(loc=50.0, scale=7.0, size=(120, 16, 2)).astype(np.float32)  # far from standardised
    y = (x[:, :, 0].mean(1) > 50).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=x[:30], y_test=y[:30])  # all of x trains: its statistics
    out = tmp_path / "run"
    train_in_process(TINY, [f"run.out_dir={out}", "data.source=arrays", f"data.files=[{tmp_path / 'd.npz'}]",
                            "model.overrides={d_model: 16, n_layer: 1, d_state: 8}", "train.max_steps=5",
                            "train.eval_every=0", "scheduler.warmup_steps=0", "log.progress_bar=false",
                            "log.log_with=[jsonl]", "sample.prompts=[]"])
    from transformers import AutoModelForSequenceClassification

    import s4accel  # noqa: F401

    model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    mean, std = x.mean(axis=(0, 1)), x.std(axis=(0, 1))
    assert model.config.input_mean == pytest.approx(mean.tolist()) and model.config.input_scale == pytest.approx(
        std.tolist(), rel=1e-5)
    encoder = model.backbone.encoder
    seen = {}
    encoder.register_forward_hook(lambda m, i, o: seen.update(x=i[0]))
    with torch.no_grad():
        model(input_values=torch.from_numpy(x[:8]))  # raw inputs, as a user of from_pretrained has them
    torch.testing.assert_close(seen["x"], torch.from_numpy((x[:8] - mean) / std), rtol=1e-5, atol=1e-5)
    pred = tmp_path / "p.jsonl"
    proc = run_cli("predict", out, tmp_path / "d.npz", "--out", pred)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with torch.no_grad():
        probs = torch.softmax(model(input_values=torch.from_numpy(x)).logits.double(), -1)
    got = [json.loads(line) for line in pred.read_text().splitlines()]
    assert len(got) == 120 and got[0]["id"] == 0
    torch.testing.assert_close(torch.tensor([[r["prob_0"], r["prob_1"]] for r in got], dtype=torch.float64), probs,
                               rtol=1e-5, atol=1e-6)


def test_a_model_exported_before_the_preprocessing_record_still_predicts_with_a_warning(trained_classifier, scenes,
                                                                                        tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(trained_classifier / "final", old)
    (old / "preprocessing.json").unlink()
    proc = run_cli("predict", old, scenes / "test.csv", "--out", tmp_path / "p.csv")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "carries no preprocessing record" in proc.stderr
    assert len(read_rows(tmp_path / "p.csv")) == len(read_rows(scenes / "test.csv"))


@pytest.mark.parametrize("record, message", [
    ('{"kind": "labelled_text", "text_field": "text", "label_field": null, "seq_len": -5, "task": "classification"}',
     "seq_len: Input should be greater than or equal to 1"),
    ('{"kind": "labelled_text", "text_field": "text", "label_field": null, "seq_len": 0, "task": "classification"}',
     "seq_len: Input should be greater than or equal to 1"),
    ('{"kind": "labelled_text", "text_field": "text", "label_field": null, "task": "classification"}',
     "seq_len: Field required"),
    ('{"kind": "labelled_text", "text_field": ', "Invalid JSON"),
    ('{"kind": "text", "text_field": "text", "label_field": null, "seq_len": 64, "task": "causal_lm"}',
     "records 'text' data, but the model beside it reads 'labelled_text' data"),
    ('{"kind": "labelled_text", "text_field": "text", "label_field": null, "seq_len": true, "task": "classification"}',
     "seq_len: Input should be a valid integer"),
    ('{"kind": "labelled_text", "text_field": "text", "label_field": 7, "seq_len": 64, "task": "classification"}',
     "label_field: Input should be a valid string"),
], ids=["negative seq_len", "zero seq_len", "no seq_len", "bad JSON", "another kind of model", "true as seq_len",
        "a number as label_field"])
def test_a_bad_preprocessing_record_is_one_line_naming_the_file_not_a_silent_answer(trained_classifier, scenes,
                                                                                     tmp_path, record, message):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(trained_classifier / "final", model)
    (model / "preprocessing.json").write_text(record)
    proc = run_cli("predict", model, scenes / "test.csv", "--out", tmp_path / "p.csv")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "p.csv").exists()
    assert f"{model / 'preprocessing.json'}: " in proc.stderr and message in proc.stderr, proc.stderr


def test_predict_gives_one_row_for_every_example_blank_and_null_ones_too(trained_classifier, tmp_path):
    """A batch of only empty documents used to reach the model with no position at all (math domain error)."""
    data = tmp_path / "blank.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"id": "a", "text": "To be, or not to be"},
                                                            {"id": "b", "text": ""}, {"id": "c", "text": None}]))
    out = tmp_path / "p.csv"
    proc = run_cli("predict", trained_classifier, data, "--out", out, "--batch-size", "1")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [r["id"] for r in read_rows(out)] == ["a", "b", "c"]


def test_predict_writes_the_examples_id_column_once_when_it_is_kept_too(trained_classifier, tmp_path):
    """A `uid` column is the examples' id (written as `id`); `--keep uid` wrote the same values again as `uid`."""
    data = tmp_path / "uid.jsonl"
    data.write_text("".join(json.dumps({"uid": f"u{i}", "text": "To be, or not to be", "act": i}) + "\n"
                            for i in range(3)))
    out = tmp_path / "p.csv"
    proc = run_cli("predict", trained_classifier, data, "--out", out, "--keep", "uid,act")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_rows(out)
    assert list(rows[0])[:3] == ["id", "act", "prediction"] and "uid" not in rows[0]
    assert [r["id"] for r in rows] == ["u0", "u1", "u2"] and [r["act"] for r in rows] == ["0", "1", "2"]

