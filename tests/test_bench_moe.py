"""bench/moe.py: its Mixtral-style baseline computes the same layer, and the harness prints the JSON it promises
(at tiny sizes: this checks the harness, not speed)."""

import json
import subprocess
import sys

import torch

from conftest import REPO


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


def test_moe_bench_prints_timings_and_ratios_as_json():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "moe.py"), "--tokens", "64", "--d-model", "16",
                           "--d-ffn", "8", "--configs", "4:2", "8:1", "--repeats", "2", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert set(out["results"]) == {"E4_k2", "E8_k1"}
    for entry in out["results"].values():
        assert set(entry["seconds_median"]) == {"moe", "moe_grouped", "moe_loop", "dense", "onehot_loop",
                                                 "matmuls_only"}
        assert all(t > 0 for t in entry["seconds_median"].values())
        assert entry["moe_over_dense"]["paired_median"] > 0
        assert entry["onehot_loop_over_moe"]["paired_median"] > 0
