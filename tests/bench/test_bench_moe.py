"""bench/moe.py: its Mixtral-style baseline computes the same layer, and the harness prints the JSON it promises
(at tiny sizes: this checks the harness, not speed)."""

import json
import sys

import pytest
import torch

from helpers import REPO, run_python

VARIANTS = {"moe", "moe_grouped", "moe_loop", "dense", "onehot_loop", "matmuls_only", "routing_only",
            "dense_matmuls_only", "harness", "moe_compiled_routing", "routing_only_compiled",
            "moe_compiled_experts", "moe_torch_ops", "moe_torch_router"}


def test_onehot_loop_baseline_computes_the_same_layer():
    sys.path.insert(0, str(REPO / "bench"))
    from moe import onehot_loop_forward

    from s4accel.models.configuration_moe import MoEConfig
    from s4accel.models.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(d_model=16, d_ffn=24, n_head=2, num_experts=8, num_experts_per_tok=2), 16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(50, 16)
    torch.testing.assert_close(onehot_loop_forward(layer, x), layer(x)[0], rtol=1e-5, atol=1e-6)


def test_routing_only_runs_the_layers_routing_and_its_backward_without_the_experts():
    sys.path.insert(0, str(REPO / "bench"))
    from moe import NoExperts

    from s4accel.models.configuration_moe import MoEConfig
    from s4accel.models.moe import MoELayer

    for dispatch in ("fused", "grouped_mm"):  # the CPU's dispatch and the GPU's static layout
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(d_model=16, d_ffn=24, n_head=2, num_experts=8, num_experts_per_tok=2,
                                   moe_dispatch=dispatch), 16)
        layer.experts = NoExperts()
        y, aux = layer(torch.randn(2, 5, 16))
        (y.sum() + aux["balance_loss"] + aux["z_loss"]).backward()
        assert y.shape == (2, 5, 16) and layer.router.weight.grad.abs().sum() > 0
        assert aux["expert_counts"].sum() == 2 * 5 * 2


def run_bench(*args):
    proc = run_python(str(REPO / "bench" / "moe.py"), "--tokens", "64", "--d-model", "16", "--d-ffn", "8", "--repeats",
                      "2", "--threads", "1", *args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_moe_bench_prints_timings_and_ratios_as_json():
    out = run_bench("--configs", "4:2", "8:1")
    assert set(out["results"]) == {"E4_k2", "E8_k1"}
    for entry in out["results"].values():
        assert entry["unavailable"] == {}
        assert set(entry["seconds_median"]) == VARIANTS
        assert all(t > 0 for t in entry["seconds_median"].values())
        m = entry["seconds_median"]
        assert entry["floor_over_dense"] == pytest.approx(
            (m["matmuls_only"] + m["routing_only"] - m["harness"] + m["dense"] - m["dense_matmuls_only"]) / m["dense"])
        assert entry["moe_over_dense"]["paired_median"] > 0
        assert entry["onehot_loop_over_moe"]["paired_median"] > 0
        assert entry["compiled_routing_over_eager"]["paired_median"] > 0
        assert entry["kernels_over_torch_ops"]["paired_median"] > 0
        assert entry["router_kernel_over_torch"]["paired_median"] > 0


def test_moe_bench_runs_under_bf16_autocast_and_says_what_it_left_out():
    out = run_bench("--configs", "4:2", "--dtype", "bfloat16", "--allocator", "glibc")
    assert out["config"]["dtype"] == "bfloat16" and out["config"]["device"] == "cpu"
    entry = out["results"]["E4_k2"]
    assert {"moe", "dense", "onehot_loop", "matmuls_only"} <= set(entry["seconds_median"])
    assert set(entry["seconds_median"]) | set(entry["unavailable"]) == VARIANTS
    assert entry["moe_over_dense"]["paired_median"] > 0


def test_a_variant_without_a_kernel_here_is_reported_and_left_out(monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    import moe as bench_moe

    real_build = bench_moe.build

    def build(args, E, k):
        fns = real_build(args, E, k)

        def no_kernel():
            raise NotImplementedError("grouped_mm: no kernel for this dtype\nmore detail")
        return {**fns, "moe_grouped": no_kernel}

    monkeypatch.setattr(bench_moe, "build", build)
    threads = torch.get_num_threads()
    try:
        bench_moe.main(["--tokens", "32", "--d-model", "8", "--d-ffn", "4", "--configs", "4:2", "--repeats", "1",
                        "--threads", str(threads), "--allocator", "glibc"])
    finally:
        torch.set_num_threads(threads)  # main() sets it for the whole process
    entry = json.loads(capsys.readouterr().out)["results"]["E4_k2"]
    assert entry["unavailable"] == {"moe_grouped": "NotImplementedError: grouped_mm: no kernel for this dtype"}
    assert "moe_grouped" not in entry["seconds_median"] and entry["moe_grouped_over_moe"] is None
    assert entry["moe_over_dense"]["paired_median"] > 0
