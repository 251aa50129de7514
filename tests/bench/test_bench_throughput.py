"""bench/throughput.py prints the JSON it promises: per family tokens/s, model TFLOP/s and MFU against the peak it
measured in the same run (at tiny sizes: this checks the harness, not speed)."""

import json

from helpers import REPO, run_python


def test_throughput_bench_reports_mfu_against_the_peak_it_measured():
    proc = run_python(str(REPO / "bench" / "throughput.py"), "--families", "s4d", "dense", "--batch", "2", "--seq-len",
                      "32", "--steps", "1", timeout=300, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = sorted(report["peak_tflops"])[0]
    assert len(report["peak_tflops"]) == 2 and peak > 0
    for family in ("s4d", "dense"):
        r = report["families"][family]
        assert r["tokens_per_s"] > 0 and r["gflop_per_step"] > 0
        assert 0 < r["mfu"] <= 1.5 and abs(r["mfu"] - r["tflops"] / (sum(report["peak_tflops"]) / 2)) < 1e-3
