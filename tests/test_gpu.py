"""On a CUDA device: a short bf16 run trains with finite numbers, exports, and its model generates on the GPU.
Skipped where there is none (the CPU suite covers the same paths in float32 and CPU bf16)."""

import math

import pytest
import torch

from helpers import TINY, train_in_process

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_bf16_run_on_cuda_trains_exports_and_generates(text, tmp_path):
    from s4accel.tools.inference import generate_text, load_model

    out = tmp_path / "run"
    result = train_in_process(TINY, [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]",
                                     "data.seq_len=64", "train.max_steps=5", "train.eval_every=5",
                                     "train.mixed_precision=bf16", "scheduler.warmup_steps=0",
                                     "log.progress_bar=false", "sample.prompts=[]"])
    assert result.steps == 5 and all(math.isfinite(v) for v in result.eval_metrics.values())
    model = load_model(out)[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    text_out = generate_text(out, "ROMEO.", 8, temperature=0.0)
    assert text_out.startswith("ROMEO.") and len(text_out) > len("ROMEO.")
