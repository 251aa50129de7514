"""bench/loop_overhead.py runs and prints the JSON it promises (a short run: this checks the harness, not speed)."""

import json

import pytest

from helpers import REPO, run_python

pytestmark = pytest.mark.slow


def test_loop_overhead_bench_prints_paired_ratios_as_json_and_writes_a_dated_file(tmp_path):
    proc = run_python(str(REPO / "bench" / "loop_overhead.py"), "--sizes", "tiny", "--rounds", "3", "--loops",
                      "accelerate", "accelerate_cached", "s4accel", "--out-dir", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    [written] = tmp_path.glob(f"{report['date']}-loop-overhead-cpu-{report['commit']}.json")
    assert json.loads(written.read_text()) == report
    assert {"torch", "accelerate", "transformers", "python", "machine", "command"} <= set(report)
    tiny = report["results"]["tiny"]
    assert set(tiny["ms_per_step_median"]) == {"accelerate", "accelerate_cached", "s4accel"}
    assert all(v > 0 for v in tiny["ms_per_step_median"].values())
    ratio = tiny["s4accel_over_accelerate"]
    assert 0 < ratio["q1"] <= ratio["median"] <= ratio["q3"]
    assert tiny["s4accel_over_accelerate_cached"]["median"] > 0
    assert tiny["s4accel_over_trainer"] is None  # the Trainer did not run
