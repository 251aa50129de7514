"""Mixed precision from the recipe: bf16 autocast trains on CPU with float32 master weights; fp16 on CPU warns."""

import math

import pytest

from helpers import TINY

pytestmark = pytest.mark.slow


def _train(tmp_path, precision):
    import s4accel
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # each run builds its own Accelerator in this process
    GradientState._reset_state()
    recipe = s4accel.load_recipe(TINY, [f"run.out_dir={tmp_path / precision}", "train.max_steps=3",
                                        f"train.mixed_precision={precision}", "train.eval_every=0",
                                        "checkpoint.every_steps=0", "log.log_with=[jsonl]", "log.progress_bar=false",
                                        "sample.prompts=[]"])
    return s4accel.train(recipe)


def test_bf16_autocast_trains_and_exports_float32_weights(tmp_path, hf_cache):
    import torch
    from safetensors.torch import load_file

    result = _train(tmp_path, "bf16")
    assert math.isfinite(result.eval_metrics["loss"])
    weights = load_file(result.final_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}  # autocast computes in bf16, stores fp32


def test_fp16_on_cpu_warns_that_it_runs_float32(tmp_path, hf_cache):
    with pytest.warns(UserWarning, match="fp16 mixed precision has no effect on CPU"):
        result = _train(tmp_path, "fp16")
    assert math.isfinite(result.eval_metrics["loss"])
