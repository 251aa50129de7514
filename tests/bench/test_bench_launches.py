"""bench/launches.py prints the launch counts and host times it promises, the baseline beside them (the harness)."""

import json

from helpers import REPO, run_python


def test_launches_bench_counts_both_variants_and_writes_a_dated_file(tmp_path):
    proc = run_python(str(REPO / "bench" / "launches.py"), "--rounds", "3", "--out-dir", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    # Exact counts: the hand-written generation launches fewer operations than plain autograd on every path, and
    # alone at most 80% of them (measured: 147 against 198 with ZOH, 177 against 226 bilinear)
    for key, n in out["launches"].items():
        if key.endswith("/fast"):
            reference = out["launches"][key.replace("/fast", "/reference")]
            assert 0 < n < (0.8 if key.startswith("generation/") else 1) * reference, key
    for disc in ("zoh", "bilinear"):  # the fused path's matrices as two Triton kernels (measured: 90 against 147)
        if f"generation/{disc}/kernels" in out["launches"]:
            assert out["launches"][f"generation/{disc}/kernels"] < 0.7 * out["launches"][f"generation/{disc}/fast"]
    assert set(out["host_ms"]) == {"fast", "reference"} and out["host_fast_over_reference"]["paired_median"] > 0
    # the MoE layer with its routing eager, whose routing is most of its operations (measured: 100 of 134), and its
    # host time with the routing eager and compiled
    assert 0.5 * out["launches"]["moe/grouped_mm"] < out["launches"]["moe/routing"] < out["launches"]["moe/grouped_mm"]
    assert set(out["moe_host_ms"]) == {"eager_routing", "compiled_routing"}
    assert out["moe_compiled_over_eager_routing"]["paired_median"] > 0
    (written,) = tmp_path.glob("*-launches-cpu-*.json")
    assert len(json.loads(written.read_text())["samples_ms"]["fast"]) == 3
