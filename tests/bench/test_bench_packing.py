"""bench/packing.py runs at a tiny size and prints the JSON it promises (the harness, not the speed)."""

import json

import pytest

from helpers import REPO, run_python


def bench(*args):
    proc = run_python(str(REPO / "bench" / "packing.py"), *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_packing_throughput_reports_both_readings_and_their_ratio():
    out = bench("throughput", "--families", "s4d", "moe", "--seq-lens", "256", "--tokens", "512", "--rounds", "2",
                "--corpora", "paragraphs")
    for family in ("s4d", "moe"):
        row = out["results"][f"paragraphs/256/{family}"]
        assert row["batch"] == 2 and row["documents_per_block"] > 1  # short documents: several per block
        assert row["tokens_per_s"]["concat"] > 0 and row["tokens_per_s"]["isolated"] > 0
        assert row["isolated_over_concat"]["min"] <= row["isolated_over_concat"]["median"]


@pytest.mark.slow
def test_packing_quality_trains_both_ways_and_scores_both_readings():
    out = bench("quality", "--steps", "2", "--seq-len", "64", "--batch", "2", "--documents", "2000")
    assert out["documents"] == 2000
    for trained in ("trained_concat", "trained_isolated"):
        scores = out["results"][trained]["bits_per_byte"]
        assert set(scores) == {"read_isolated", "read_concat"} and all(0 < v < 20 for v in scores.values())
