"""`s4accel export`: any training checkpoint of a run as a `from_pretrained` folder, equal bit for bit to the live
weights at its step, also for a run killed before its final/; the user's mistakes are one line before anything is
written; reading a checkpoint never unpickles more than tensors. The FSDP-sharded case is in test_fsdp.py."""

import hashlib
import json
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file

from helpers import RECIPES, TINY, final_weights, run_cli, short_epochs, train_in_process
from s4accel.errors import S4AccelError
from s4accel.tools.export import export_checkpoint
from s4accel.training.runs.checkpoint_weights import read_model_weights


@pytest.fixture(scope="module")
def run(tmp_path_factory, text):
    """One process, 16 steps, checkpoints at steps 8 and 16, EMA on; a BPE trained on the run's text, whose
    vocabulary (a few hundred tokens) is smaller than the recipe's data.vocab_size (4096): only the run's own
    tokenizer/ folder tells the model's shape."""
    out = tmp_path_factory.mktemp("export") / "run"
    result = train_in_process(TINY, short_epochs(text, out, "train.max_steps=16", "checkpoint.every_steps=8",
                                                 "checkpoint.keep_last=4", "data.tokenizer=bpe"))
    assert result.steps == 16 and (out / "checkpoints" / "step_00000008").is_dir()
    return out


def loaded(folder, auto=None):
    from transformers import AutoModelForCausalLM

    return (auto or AutoModelForCausalLM).from_pretrained(folder, trust_remote_code=True)


def assert_same_model(folder, reference, auto=None):
    """Every file of `reference` (config, generation config, tokenizer, code, preprocessing, weights) is in `folder`
    byte for byte, and the two load to equal state dicts."""
    for f in reference.iterdir():
        assert (folder / f.name).read_bytes() == f.read_bytes(), f.name
    ref, got = loaded(reference, auto).state_dict(), loaded(folder, auto).state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_export_of_the_last_checkpoint_equals_the_final_model(run, tmp_path):
    out = tmp_path / "step16"
    proc = run_cli("export", run, out, "--step", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 16 (full checkpoint" in proc.stdout
    assert_same_model(out, run / "final")
    assert {"README.md", "recipe.yaml", "metrics.json", "training_curve.png"} <= {p.name for p in out.iterdir()}
    assert "These are the run's **step 16** weights." in (out / "README.md").read_text()
    assert json.loads((out / "metrics.json").read_text())["eval"]["step"] == 16
    machine = str(run.parents[1]).encode()  # pytest's base folder: the run, its text and OUT are all under it
    assert not [f.name for f in out.iterdir() if machine in f.read_bytes()]  # the card's recipe names files by name
    assert yaml.safe_load((out / "recipe.yaml").read_text())["data"]["files"] == ["play.txt"]


def test_ema_export_of_the_last_checkpoint_equals_the_final_ema_model(run, tmp_path):
    export_checkpoint(run, tmp_path / "ema", step=16, ema=True)
    assert_same_model(tmp_path / "ema", run / "final_ema")


def test_a_run_killed_before_its_end_exports_its_newest_complete_checkpoint(run, tmp_path):
    from transformers import AutoTokenizer

    killed = tmp_path / "killed"  # no final/, the step-16 save cut short
    shutil.copytree(run, killed, ignore=shutil.ignore_patterns("final", "final_ema", "step_00000016"))
    shutil.copytree(run / "checkpoints" / "step_00000016", killed / "checkpoints" / ".tmp_step_00000016")
    out = tmp_path / "out"
    proc = run_cli("export", killed, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 8" in proc.stdout and "interrupted" in proc.stderr
    saved = load_file(out / "model.safetensors")
    live = load_file(run / "checkpoints" / "step_00000008" / "model.safetensors")  # the weights at step 8
    assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in live)
    final = final_weights(run)
    assert any(not torch.equal(saved[k], final[k]) for k in final)  # step 8's model, not the last one
    assert "lm_head.weight" not in saved  # tied to the embeddings: stored once
    model, tokenizer = loaded(out), AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "S4ForCausalLM" and model.lm_head.weight is model.backbone.embeddings.weight
    ids = tokenizer("ROMEO.", return_tensors="pt").input_ids
    new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert new.shape[1] == ids.shape[1] + 8


def test_a_classifier_exports_the_labels_and_input_statistics_its_data_gave(tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "digits"
    train_in_process(RECIPES / "digits.yaml", [
        f"run.out_dir={out}", "model.overrides={d_model: 16, n_layer: 1, d_state: 8, bidirectional: true}",
        "train.max_steps=4", "train.eval_every=4", "train.eval_max_batches=2", "checkpoint.every_steps=4",
        "scheduler.warmup_steps=1", "log.progress_bar=false"])
    export_checkpoint(out, tmp_path / "exported")
    assert_same_model(tmp_path / "exported", out / "final", AutoModelForSequenceClassification)
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert len(config["id2label"]) == 10 and config["input_mean"] is not None  # what the data gave


def rewritten(run, tmp_path, change) -> object:
    """A copy of the run whose step-16 checkpoint's recipe is changed by `change(recipe)`, its manifest updated."""
    copy = tmp_path / "changed"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("final*", "step_00000008"))
    ckpt = copy / "checkpoints" / "step_00000016"
    recipe = yaml.safe_load((ckpt / "recipe.yaml").read_text())
    change(recipe)
    text = yaml.safe_dump(recipe)
    (ckpt / "recipe.yaml").write_text(text)
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    manifest["files"]["recipe.yaml"] = {"size": len(text.encode()),
                                        "sha256": hashlib.sha256(text.encode()).hexdigest()}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))
    return copy


def truncated(run, tmp_path):
    copy = tmp_path / "broken"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("final*", "step_00000008"))
    weights = copy / "checkpoints" / "step_00000016" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return copy


@pytest.mark.parametrize("case, expected", [
    ("no checkpoint", "no checkpoint to export"),
    ("no such step", "--step 12: "),
    ("incomplete", "is truncated"),
    ("incomplete, newest", "no complete checkpoint"),
    ("out not empty", "exists and is not empty; choose another folder, or add --overwrite"),
    ("out under a file", "is a file, not a folder"),
    ("out is the run", "would replace the run directory"),
    ("task of your own", "a task of your own"),
    ("ema without ema", "trained without train.ema"),
])
def test_what_the_user_can_get_wrong_is_one_line_exit_2_before_anything_is_written(run, tmp_path, case, expected):
    out, step, ema, overwrite = tmp_path / "out", 16, False, False
    source = run
    if case == "no checkpoint":
        source = tmp_path / "empty"
        source.mkdir()
    elif case == "no such step":
        step = 12
    elif case.startswith("incomplete"):
        source = truncated(run, tmp_path)
        step = None if case.endswith("newest") else 16
    elif case == "out not empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "out under a file":
        (tmp_path / "afile").write_text("")
        out = tmp_path / "afile" / "out"
    elif case == "out is the run":
        source = shutil.copytree(run, tmp_path / "copy", ignore=shutil.ignore_patterns("final*"))
        out, overwrite = source, True
    elif case == "task of your own":
        source = rewritten(run, tmp_path, lambda r: r.update(task={"target": "mypkg.tasks:MyTask", "args": {}}))
    else:
        source, ema = rewritten(run, tmp_path, lambda r: r["train"].update(ema=None)), True
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(S4AccelError) as info:
        export_checkpoint(source, out, step=step, ema=ema, overwrite=overwrite)
    assert info.value.exit_code == 2 and len(str(info.value).splitlines()) == 1 and expected in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing beside OUT either
    if case == "out not empty":
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
    if case == "out is the run":
        assert (source / "checkpoints" / "step_00000016" / "COMPLETE").is_file()


def test_the_cli_lists_the_steps_there_are_in_one_line(run, tmp_path):
    proc = run_cli("export", run, tmp_path / "out", "--step", "12")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines() == [f"error: --step 12: {run} has no checkpoint of that step (it has "
                                                f"steps 8, 16)"]


class RunsCode:
    """Unpickling it creates `marker`: what a crafted checkpoint could do instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return self.marker.touch, ()


def sharded_checkpoint(path, model_state: dict):
    """A checkpoint folder holding `{"model": model_state}` as FSDP's sharded state dict is saved."""
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model_state}, checkpoint_id=path / "pytorch_model_fsdp_0", no_dist=True)
    return path


def test_a_sharded_checkpoint_is_read_back_whole_with_plain_names(tmp_path):
    state = {"backbone.embeddings.weight": torch.randn(5, 3), "lm_head._orig_mod.bias": torch.arange(4.0)}
    got = read_model_weights(sharded_checkpoint(tmp_path, state))
    assert got.keys() == {"backbone.embeddings.weight", "lm_head.bias"}
    assert torch.equal(got["backbone.embeddings.weight"], state["backbone.embeddings.weight"])


def test_a_sharded_index_that_would_run_code_is_refused_without_running_it(tmp_path):
    ckpt = sharded_checkpoint(tmp_path, {"w": torch.ones(2)})
    marker = tmp_path / "ran"
    (ckpt / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(S4AccelError, match="not a checkpoint index torch wrote"):
        read_model_weights(ckpt)
    assert not marker.exists()


def test_a_sharded_entry_that_is_not_a_tensor_is_refused_without_unpickling_it(tmp_path):
    marker = tmp_path / "ran"
    ckpt = sharded_checkpoint(tmp_path, {"w": torch.ones(2), "extra": RunsCode(marker)})
    with pytest.raises(S4AccelError, match="'model.extra', which is not a tensor"):
        read_model_weights(ckpt)
    assert not marker.exists()
