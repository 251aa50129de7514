"""bench/gpu_check.py, the one command that runs every GPU-only path: without a GPU it says so in JSON and fails,
and its sections run as a dry run on the CPU (small shapes; this checks the script and the CPU side of the paths it
compares, not a GPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO

SCRIPT = REPO / "bench" / "gpu_check.py"


def gpu_check(*args):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_fails():
    proc, reports = gpu_check("--only", "documents")
    assert proc.returncode == 1 and reports == [{"error": "no CUDA device: nothing here runs without one"}]


def test_its_sections_run_as_a_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "report.json"
    proc, reports = gpu_check("--device", "cpu", "--quick", "--only", "moe_dispatch", "s4d_layer", "documents",
                              "no_sync", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert reports[-1] == {"ok": True, "failed": []} and report["ok"]
    moe = report["moe_dispatch"]
    for dtype in ("bfloat16", "float32"):  # grouped_mm, fused and the loop compute the same layer
        assert set(moe[dtype]["ms"]) == {"loop", "fused", "grouped_mm"}
        assert moe[dtype]["grouped_mm_vs_loop"] < (2e-2 if dtype == "bfloat16" else 1e-5)
    assert report["s4d_layer"]["auto/L256"]["fwd_bwd_ms"] > 0 and report["s4d_layer"]["fft/L256"]["fwd_bwd_ms"] > 0
    for family in ("s4d", "moe"):
        assert report["documents"][family]["next_document_bit_identical"]
        assert report["documents"][family]["packed_vs_alone"] < 1e-4
    assert {k: v["synchronises"] for k, v in report["no_sync"].items() if isinstance(v, dict) and "synchronises" in v
            } == {"moe": False, "s4_moe": False, "s4d": False, "s4_dplr": False}  # the check runs on CUDA
    ops = report["no_sync"]["moe_ops"]  # each op alone: counted on CUDA, run here
    assert {"embedding_tied_head", "rms_norm", "rotary", "sdpa_default", "sdpa_math"} <= set(ops)
    assert ops["rms_norm"] == 0 and ops["sdpa_math"] == 0
