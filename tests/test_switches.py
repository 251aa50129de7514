"""Speed and memory switches of a recipe: activation checkpointing, torch.compile, fused AdamW (TF32 needs CUDA), and
the profiler over chosen steps."""

import json

import pytest
import torch

from helpers import TINY, callback_override, final_weights, small_text_file, train_in_process


def tiny(out, text, *extra):
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4",
            "model.overrides={dropout: 0.1}", "train.max_steps=6", "train.eval_every=0", "log.progress_bar=false",
            "checkpoint.every_steps=0", "sample.prompts=[]", *extra]


def test_activation_checkpointing_trains_the_same_model_bit_for_bit(tmp_path, text):
    plain = train_in_process(TINY, tiny(tmp_path / "plain", text))
    ckpt = train_in_process(TINY, tiny(tmp_path / "ac", text, "train.activation_checkpointing=true"))
    a, b = final_weights(tmp_path / "plain"), final_weights(tmp_path / "ac")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ckpt.eval_metrics == plain.eval_metrics


def test_activation_checkpointing_on_a_model_without_it_is_a_recipe_error(tmp_path):
    from helpers import REPO
    from s4accel.errors import RecipeError

    with pytest.raises(RecipeError, match="train.activation_checkpointing: DiabetesMLP has no "
                                          "activation_checkpointing_enable"):
        train_in_process(REPO / "examples" / "diabetes.yaml",
                         [f"run.out_dir={tmp_path}", "train.activation_checkpointing=true",
                          f"task.target={REPO / 'examples' / 'diabetes_regression.py'}:DiabetesRegression"])


def test_adamw_is_fused_where_the_device_has_the_kernel_unless_turned_off():
    from s4accel.config import OptimCfg
    from s4accel.training.optim import build_optimizer

    model = torch.nn.Linear(4, 4)
    assert build_optimizer(model, OptimCfg(), "cpu").defaults["fused"] is True
    off = build_optimizer(model, OptimCfg(fused=False), "cpu").defaults
    assert not off["fused"] and off["foreach"] is True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_run_matches_eager_and_exports_plain_parameter_names(tmp_path, text, mode):
    """Accelerate's regional compilation names parameters `layers.0._orig_mod.norm.weight`, a whole-model compile
    (the CUDA graph modes) `_orig_mod.s4.layers...`; the export must not. Without CUDA reduce-overhead captures
    nothing and compiles the whole model."""
    from transformers import AutoModelForCausalLM

    seen = tmp_path / "loss_compiled.json"
    eager = train_in_process(TINY, tiny(tmp_path / "eager", text, "model.overrides={dropout: 0.0}"))
    compiled = train_in_process(TINY, tiny(tmp_path / "compiled", text, "model.overrides={dropout: 0.0}",
                                           "train.compile=true", f"train.compile_mode={mode}",
                                           callback_override("testing_callbacks:LossCompiled", path=str(seen))))
    # block by block, the loss is compiled beside the blocks; compiled whole, it is inside the whole model's graph
    assert json.loads(seen.read_text()) is (mode == "default")
    a, b = final_weights(tmp_path / "eager"), final_weights(tmp_path / "compiled")
    assert a.keys() == b.keys() and not any("_orig_mod" in k for k in b)
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)
    assert compiled.eval_metrics["loss"] == pytest.approx(eager.eval_metrics["loss"], rel=1e-4)
    AutoModelForCausalLM.from_pretrained(tmp_path / "compiled" / "final")  # loads without missing keys


def test_profile_traces_the_chosen_steps_into_the_run_directory(tmp_path):
    from helpers import short_epochs, train_in_process

    text = small_text_file(tmp_path)
    run = tmp_path / "run"
    train_in_process(TINY, short_epochs(text, run, "train.max_steps=7", "checkpoint.every_steps=100",
                                        "train.profile={wait: 2, warmup: 1, active: 2}"))
    traces = list((run / "profile").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#3", "ProfilerStep#4"]  # optimizer steps 4 and 5: after 2 waited, 1 warmed up
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the model's operators are in it
    assert "Self CPU" in (run / "profile" / "summary.txt").read_text()
    log = (run / "train.log").read_text()
    assert f"profile: steps 4-5 traced into {run / 'profile'}" in log

    # a run that ends before the schedule's active steps: nothing half-written, the run ends normally
    short = tmp_path / "short"
    result = train_in_process(TINY, short_epochs(text, short, "train.max_steps=3", "checkpoint.every_steps=100",
                                                 "train.profile={wait: 2, warmup: 1, active: 2}"))
    assert result.steps == 3 and not list((short / "profile").glob("*.json"))
    assert "profile: the run ended before step 5, the last one to profile; no trace written" in (
        short / "train.log").read_text()
