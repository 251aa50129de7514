"""bench/lra_listops.py runs at a tiny size and prints the JSON it promises (this checks the harness, not the
comparison): every model trained for the time asked on the same generated data, accuracies beside the majority rate."""

import json

from helpers import REPO, run_python

TINY = ["--lengths", "24", "48", "--seconds", "1", "--train", "48", "--val", "8", "--test", "16", "--d-model", "8",
        "--layers", "1", "--d-state", "4", "--heads", "2", "--batch", "4", "--max-depth", "4", "--threads", "1"]


def test_lra_listops_bench_trains_each_model_for_the_same_time_and_prints_json():
    proc = run_python(str(REPO / "bench" / "lra_listops.py"), *TINY, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert set(out["lengths"]) == {"24", "48"} and out["config"]["seconds"] == 1
    for L, entry in out["lengths"].items():
        assert entry["symbols"]["max"] <= int(L) and entry["symbols"]["min"] >= int(L) // 4
        assert 0.1 <= entry["test_majority_rate"] <= 1  # 16 test labels among 10 classes: at least 2 agree
        assert set(entry["models"]) == {"s4", "transformer", "gru"}
        for model in entry["models"].values():
            assert model["steps"] >= 1 and 1 <= model["train_seconds"] < 10  # stops at the first step past 1 s
            assert model["test_accuracy"] in {k / 16 for k in range(17)}  # over the 16 test expressions
            assert model["parameters"] > 0
        assert set(entry["s4_minus"]) == {"transformer", "gru"}
