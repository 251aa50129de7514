"""bench/speed_switches.py runs at a tiny size and prints the JSON it promises (the harness, not the speed)."""

import json

from helpers import REPO, run_python


def test_speed_switches_bench_prints_medians_and_ratios_to_eager(tmp_path):
    proc = run_python(str(REPO / "bench" / "speed_switches.py"), "--size", "s4-tiny", "--batch", "2", "--seq-len",
                      "32", "--rounds", "2", "--steps", "2", "--warmup", "1", "--variants", "eager", "ckpt",
                      "--out-dir", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert set(out["median"]) == {"eager", "ckpt"} and len(out["rounds"]) == 2
    assert all(out["median"][v]["step_s"] > 0 for v in ("eager", "ckpt"))
    # activation checkpointing keeps fewer saved tensors: an exact count, not a timing
    assert out["over_eager"]["ckpt"]["saved_mb"]["of_medians"] < 0.5
    (written,) = tmp_path.glob("*-speed-switches-cpu-*.json")
    assert json.loads(written.read_text())["machine"]["torch"] == out["machine"]["torch"]
