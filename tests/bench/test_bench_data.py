"""bench/data.py runs and reports what docs/how-to/data.md quotes: MB/s per method, the fast path's blocks equal to
the old way's, the cache's bytes per token."""

import json

import pytest

from helpers import REPO, run_python

pytestmark = pytest.mark.slow


def test_data_bench_reports_rates_and_the_same_blocks_as_the_old_way():
    proc = run_python(str(REPO / "bench" / "data.py"), "--mb", "6", "--baseline-mb", "1", "--repeats", "1",
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert set(out["mb_per_s"]) == {"byte", "subword", "baseline", "subword_tokenizer_alone"}
    assert all(v > 0 for v in out["mb_per_s"].values())
    assert out["same_blocks_as_baseline"] and out["byte_over_baseline"] > 5
    assert out["cache_bytes_per_token"]["byte"] < 2.2  # uint16 ids, not int64 lists
