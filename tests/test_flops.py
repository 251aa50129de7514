"""The analytic FLOP count of a training step (s4accel/training/observe/flops.py) against what torch's own
`FlopCounterMode` counts on a real forward and backward, for every model family, and what a run reports with it
(`train/tflops`, `train/mfu`, the line it ends with)."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM, S4ForSequenceClassification
from s4accel.training.observe.flops import step_flops

aten = torch.ops.aten


def raw(formula):  # FlopCounterMode hands such a formula the tensors themselves, not only their shapes
    formula._get_raw = True
    return formula


def matmul_cost(a, b):  # torch counts 2 M K N whatever the dtype; a complex product is 4 real ones of that size
    flops = 2 * math.prod(a.shape) * b.shape[-1]
    return 4 * flops if a.is_complex() else flops


def fft_cost(shape, dim, n):  # 2.5 n log2 n per transformed row of a real FFT of length n
    return 2.5 * n * math.log2(n) * math.prod(shape) / shape[dim[-1]]


# What FlopCounterMode does not count by itself: complex matmuls at their real cost, in-place addmm (the experts'
# weight gradients accumulated over windows), FFTs, and the CPU's fused attention kernel.
COUNTED = {
    aten.mm: raw(lambda a, b, *_, out_val=None, **__: matmul_cost(a, b)),
    aten.bmm: raw(lambda a, b, *_, out_val=None, **__: matmul_cost(a, b)),
    aten.addmm: raw(lambda bias, a, b, *_, out_val=None, **__: matmul_cost(a, b)),
    aten.addmm_: raw(lambda bias, a, b, *_, out_val=None, **__: matmul_cost(a, b)),
    aten._fft_r2c: lambda x, dim, normalization, onesided, out_shape=None, **_: fft_cost(x, dim, x[dim[-1]]),
    aten._fft_c2r: lambda x, dim, normalization, n, out_shape=None, **_: fft_cost(x, dim, n),
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, out_shape=None, **__: sdpa_flop_count(
        q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k, v, *_, out_shape=None, **__:
        sdpa_backward_flop_count(g, q, k, v),
}

V = 256
FAMILIES = {
    "s4d": lambda: S4ForCausalLM(S4Config(vocab_size=V, d_model=128, n_layer=2, d_state=64)),
    "s4_dplr": lambda: S4ForCausalLM(S4Config(vocab_size=V, d_model=128, n_layer=2, d_state=64, kernel="s4",
                                              l_max=512)),
    "s4_bidirectional_classifier": lambda: S4ForSequenceClassification(S4Config(
        vocab_size=V, d_model=128, n_layer=2, d_state=64, bidirectional=True, ffn="mlp", d_ffn=256, num_labels=5)),
    "s4_moe": lambda: S4ForCausalLM(S4Config(vocab_size=V, d_model=128, n_layer=2, d_state=64, ffn="moe",
                                             num_experts=8, d_ffn=256)),
    "moe": lambda: MoEForCausalLM(MoEConfig(vocab_size=V, d_model=128, n_layer=2, n_head=4, d_ffn=256,
                                            num_experts=8, num_shared_experts=1)),
    "dense": lambda: MoEForCausalLM(MoEConfig(vocab_size=V, d_model=128, n_layer=2, n_head=4, d_ffn=256,
                                              use_moe=False)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("batch, length", [(8, 512), (2, 1000)])
def test_the_analytic_count_of_a_training_step_is_within_5_percent_of_flop_counter_mode(family, batch, length):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    classifier = isinstance(model, S4ForSequenceClassification)
    ids = torch.randint(3, V, (batch, length))
    labels = torch.randint(0, 5, (batch,)) if classifier else ids
    counter = FlopCounterMode(display=False, custom_mapping=COUNTED)
    with counter:
        model(input_ids=ids, labels=labels).loss.backward()
    parts = step_flops(model.config, batch, length, classifier)
    analytic = sum(v for k, v in parts.items() if k != "spectral_products")  # elementwise: neither counts it
    measured = counter.get_total_flops()
    assert abs(analytic / measured - 1) < 0.05, (family, analytic / measured, parts)


def test_a_run_reports_its_model_flops_and_their_share_of_the_peak(text, tmp_path):
    from helpers import TINY, read_metrics, train_in_process

    result = train_in_process(TINY, [f"run.out_dir={tmp_path}", "data.source=files", f"data.files=[{text}]",
                                     "train.max_steps=4", "log.log_every=2", "log.progress_bar=false",
                                     "sample.prompts=[]", "train.peak_tflops=0.5"])
    logged = [r for r in read_metrics(tmp_path) if "train/tflops" in r]
    assert len(logged) == 2
    for r in logged:  # tokens/s x FLOPs per token, and that over the peak given
        assert r["train/tflops"] > 0 and r["train/mfu"] == pytest.approx(r["train/tflops"] / 0.5)
    assert result.throughput["mfu"] == pytest.approx(result.throughput["tflops"] / 0.5)
