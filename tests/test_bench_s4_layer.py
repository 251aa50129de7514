"""bench/s4_layer.py runs at tiny sizes and prints the JSON it promises (this checks the harness, not speed). No
reference is given, so its absence must be reported, not fatal."""

import json
import subprocess
import sys

from conftest import REPO

TINY = ["--lengths", "32", "64", "--batch", "2", "--d-model", "16", "--d-state", "8", "--repeats", "1",
        "--breakdown-length", "32", "--decode-positions", "4", "16", "--decode-window", "4",
        "--generate-prompts", "8", "24", "--generate-tokens", "3", "--threads", "1"]


def test_s4_layer_bench_prints_timings_and_ratios_as_json():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "s4_layer.py"), *TINY],
                          capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert {"config", "machine", "layer", "breakdown", "memory", "decode", "generate"} <= set(out)
    assert "reference" in out["config"]["reference"]  # says why the reference is absent

    for L in ("32", "64"):
        entry = out["layer"][L]
        assert set(entry["seconds_median"]) == {"ours", "proposed", "attention", "gru"}
        assert all(t > 0 for t in entry["seconds_median"].values())
        assert "reference" in entry["skipped"]
        assert entry["ours_over"]["reference"] is None
        for other in ("proposed", "attention", "gru"):
            assert entry["ours_over"][other]["paired_median"] > 0
    assert "speedup_over_reference" not in out

    parts = out["breakdown"]["seconds_median"]
    assert set(parts) == {"ours", "proposed"}
    for impl in parts.values():
        assert all(impl[k] > 0 for k in ("kernel", "conv", "mix", "full"))
    assert set(out["breakdown"]["minor_page_faults_per_full_pass"]) == {"ours", "proposed"}

    memory = out["memory"]
    assert memory["no_BHNL_tensor"] is True
    assert 0 < memory["proposed"]["bytes"] < memory["bhnl_complex_bytes"]

    for batch in ("batch_1", "batch_2"):
        decode = out["decode"][batch]
        assert set(decode["ms_per_token"]) == {"4", "16"}
        assert all(t > 0 for t in decode["ms_per_token"].values())
    assert all(out["generate"]["ms_per_token"][p] > 0 for p in ("8", "24"))


def test_proposed_layer_path_matches_the_layer():
    """The prototype the bench times (faster kernel and convolution) computes the same layer, values and gradients."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from s4_layer import parse_args, proposed_forward, s4d_layer

    torch.manual_seed(0)
    layer = s4d_layer(parse_args(["--d-model", "8", "--d-state", "8"])).double()
    x = torch.randn(2, 50, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 50, 8, dtype=torch.float64)
    grads = []
    for forward in (lambda: layer(x)[0], lambda: proposed_forward(layer, x)):
        layer.zero_grad()
        x.grad = None
        y = forward()
        y.backward(g)
        grads.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = grads
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gx1, gx0, rtol=1e-10, atol=1e-12)
    for a, b in zip(gp1, gp0):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
