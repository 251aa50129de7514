"""bench/s4_layer.py runs at tiny sizes and prints the JSON it promises (this checks the harness, not speed). No
reference is given, so its absence must be reported, not fatal."""

import json

from helpers import REPO, run_python

TINY = ["--lengths", "32", "64", "--batch", "2", "--d-model", "16", "--d-state", "8", "--repeats", "1",
        "--breakdown-length", "32", "--decode-positions", "4", "16", "--decode-window", "4",
        "--generate-prompts", "8", "24", "--generate-tokens", "3", "--threads", "1"]


def test_s4_layer_bench_prints_timings_and_ratios_as_json():
    proc = run_python(str(REPO / "bench" / "s4_layer.py"), *TINY, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert {"config", "machine", "layer", "breakdown", "memory", "decode", "generate"} <= set(out)
    assert "reference" in out["config"]["reference"]  # says why the reference is absent

    for L in ("32", "64"):
        entry = out["layer"][L]
        assert set(entry["seconds_median"]) == {"ours", "attention", "gru"}
        assert all(t > 0 for t in entry["seconds_median"].values())
        assert "reference" in entry["skipped"]
        assert entry["ours_over"]["reference"] is None
        for other in ("attention", "gru"):
            assert entry["ours_over"][other]["paired_median"] > 0
    assert "speedup_over_reference" not in out

    parts = out["breakdown"]["seconds_median"]
    assert set(parts) == {"ours"}
    for impl in parts.values():
        assert all(impl[k] > 0 for k in ("kernel", "conv", "mix", "full"))
    assert set(out["breakdown"]["minor_page_faults_per_full_pass"]) == {"ours"}

    memory = out["memory"]
    assert memory["no_BHNL_tensor"] is True
    assert 0 < memory["ours"]["bytes"] < memory["bhnl_complex_bytes"]

    for batch in ("batch_1", "batch_2"):
        decode = out["decode"][batch]
        assert set(decode["ms_per_token"]) == {"4", "16"}
        assert all(t > 0 for t in decode["ms_per_token"].values())
    assert all(out["generate"]["ms_per_token"][p] > 0 for p in ("8", "24"))

