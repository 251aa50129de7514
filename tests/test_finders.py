"""`s4accel lr-find`: the exponential sweep, the divergence stop, the suggestion, and the files it writes."""

import json
import math

import pytest

from helpers import run_cli
from s4accel.tools.finders import suggest


def test_suggestion_is_where_the_smoothed_loss_falls_fastest():
    lrs = [10 ** (-6 + i * 0.25) for i in range(25)]  # 1e-6 .. 1
    # A loss that drops fastest around lr = 1e-3 (a logistic step in log10 lr centred at -3).
    losses = [1 + 3 / (1 + math.exp(4 * (math.log10(lr) + 3))) for lr in lrs]
    assert suggest(lrs, losses) == pytest.approx(1e-3, rel=0.8)
    assert suggest(lrs[:5], losses[:5]) is None  # too few points to say


@pytest.mark.slow
def test_lr_find_sweeps_stops_on_divergence_and_writes_a_plot(tmp_path, text):
    common = ["--set", "data.source=files", "--set", f"data.files=[{text}]", "--set", "data.seq_len=32"]
    proc = run_cli("lr-find", "recipes/s4_tiny_debug.yaml", *common, "--steps", "40", "--min-lr", "1e-6",
                   "--max-lr", "1e4", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "lr_find.json").read_text())
    lrs = result["lrs"]
    assert lrs[0] == pytest.approx(1e-6)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]
    assert all(r == pytest.approx(ratios[0]) for r in ratios)  # exponential
    assert result["stopped_early"] and len(lrs) < 40  # 1e4 diverges before the end
    assert lrs[0] < result["suggested_lr"] < lrs[-1]
    assert min(result["smoothed"]) < result["smoothed"][0]  # the loss did fall somewhere in the sweep
    assert (tmp_path / "lr_find.png").read_bytes().startswith(b"\x89PNG")
    assert f"suggested lr {result['suggested_lr']:.3g}" in proc.stdout


def test_bad_sweep_bounds_are_one_line():
    proc = run_cli("lr-find", "recipes/s4_tiny_debug.yaml", "--min-lr", "1", "--max-lr", "0.1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: lr-find: need 0 < min_lr < max_lr, got 1.0, 0.1"


@pytest.mark.slow
def test_find_batch_size_doubles_within_the_budget_and_says_when_nothing_fits(tmp_path, text):
    common = ["--set", "data.source=files", "--set", f"data.files=[{text}]", "--set", "data.seq_len=32"]
    proc = run_cli("find-batch-size", "recipes/s4_tiny_debug.yaml", *common, "--memory-mb", "100000",
                   "--max-batch", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.strip().splitlines() if not line.startswith("note:")]  # the cap's note
    assert [line.split(":")[0] for line in lines[:-1]] == ["batch     1", "batch     2", "batch     4"]
    assert lines[-1].startswith("largest batch size within 100,000 MiB on cpu: 4")

    proc = run_cli("find-batch-size", "recipes/s4_tiny_debug.yaml", *common, "--memory-mb", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: not even batch size 1 fits in 1 MiB on cpu"


def test_bisection_returns_the_largest_size_that_fits(monkeypatch):
    from s4accel.tools import finders

    peak = {b: 100 + 10 * b for b in range(1, 200)}  # a step's memory grows with the batch
    monkeypatch.setattr(finders, "_trial", lambda recipe, b: peak[b])
    result = finders.find_batch_size(recipe=None, memory_mb=100 + 10 * 37 + 5, max_batch=128)
    assert result.batch_size == 37
    assert list(result.peak_mb)[:7] == [1, 2, 4, 8, 16, 32, 64]  # doubled until 64 did not fit, then bisected


def test_the_cap_is_tried_and_an_answer_at_the_cap_says_so(monkeypatch, tmp_path, text):
    from s4accel.tools import finders

    monkeypatch.setattr(finders, "_trial", lambda recipe, b: 10.0 * b)
    result = finders.find_batch_size(recipe=None, memory_mb=1e9, max_batch=100)
    assert result.batch_size == 100 and result.capped  # not 64: doubling stepped over the cap
    result = finders.find_batch_size(recipe=None, memory_mb=10.0 * 90, max_batch=100)
    assert result.batch_size == 90 and not result.capped
    monkeypatch.undo()
    proc = run_cli("find-batch-size", "recipes/s4_tiny_debug.yaml", "--set", "data.source=files", "--set",
                   f"data.files=[{text}]", "--set", "data.seq_len=32", "--memory-mb", "100000", "--max-batch", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == ("note: 2 is the --max-batch cap, not a memory limit: larger "
                                                     "sizes were not tried (raise --max-batch to look further)")
