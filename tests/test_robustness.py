"""What a long run meets: bad numbers, a metric that stops improving, user callbacks, time-based checkpoints, a bad
output directory, and many checkpoints over a long run (bounded disk, flat memory)."""

import json
import math
import sys

import pytest
import torch

from helpers import (TINY, callback_override, final_weights, read_metrics, run_cli, sets,
                      train_in_process)
from s4accel.errors import NonFiniteError, RecipeError, RunDirError

pytestmark = pytest.mark.slow


def base(text, out, *extra):
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4",
            "data.val_fraction=0.1", "train.max_steps=12", "train.eval_every=0", "checkpoint.every_steps=0",
            "log.log_every=1", "log.log_with=[jsonl]", "log.progress_bar=false", "sample.prompts=[]", *extra]


def test_a_non_finite_step_is_skipped_counted_and_training_goes_on(text, tmp_path):
    nan_at_4 = callback_override("testing_callbacks:NaNForwardAt", step=4)
    result = train_in_process(TINY, base(text, tmp_path / "r", nan_at_4))
    assert result.steps == 12  # twelve real updates: the poisoned window did not count as one
    train = [r for r in read_metrics(tmp_path / "r") if "train/loss" in r]
    assert all(math.isfinite(r["train/loss"]) for r in train)
    assert [r["train/nonfinite_skips"] for r in train][3:5] == [0, 1]  # counted on the step after the skip
    assert all(torch.isfinite(t).all() for t in final_weights(tmp_path / "r").values())


def test_stop_policy_saves_the_last_good_state_and_exits_non_zero_naming_the_step(text, tmp_path):
    out = tmp_path / "r"
    args = ["train", TINY, "--set", "train.on_nonfinite=stop"]
    for item in base(text, out, callback_override("testing_callbacks:NaNForwardAt", step=4)):
        args += ["--set", item]
    proc = run_cli(*args, env={"PYTHONPATH": str(TINY.parents[1] / "tests")})
    assert proc.returncode == 3
    ckpt = out / "checkpoints" / "step_00000004"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: non-finite loss or gradient norm at step 5 (train.on_nonfinite=stop); the last good state is saved "
        f"in {ckpt}")
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(ckpt / "model.safetensors").values())
    assert not (out / "final").exists()


def test_consecutive_skips_stop_the_run_and_the_error_is_the_last_line_of_its_log(text, tmp_path):
    # Every forward after step 3 is poisoned: after max_nonfinite_skips in a row, the run stops as with `stop`.
    overrides = base(text, tmp_path / "r", "train.max_nonfinite_skips=3",
                     callback_override("testing_callbacks:NaNForwardAt", step=3, times=100))
    terminal = sys.stdout, sys.stderr
    with pytest.raises(NonFiniteError, match=r"at step 4 \(3 in a row, train.max_nonfinite_skips=3\)") as stopped:
        train_in_process(TINY, overrides)
    # A run read on a cluster afterwards says why it ended; the streams the run logged are handed back when it ends.
    assert (tmp_path / "r" / "train.log").read_text().splitlines()[-1] == stopped.value.lines()[-1]
    assert (sys.stdout, sys.stderr) == terminal


def test_early_stopping_on_patience_and_on_divergence(text, tmp_path):
    # min_delta so large that nothing after the first evaluation counts as an improvement: stop after 2 more evals.
    result = train_in_process(TINY, base(text, tmp_path / "a", "train.eval_every=2", "train.max_steps=40",
                                         "train.early_stopping={patience: 2, min_delta: 100.0}"))
    assert result.steps == 6
    first = next(r["eval/loss"] for r in read_metrics(tmp_path / "a") if "eval/loss" in r)
    assert result.stop_reason == f"early stopping: eval loss has not improved on {first:.4g} for 2 evaluations"
    assert (tmp_path / "a" / "final" / "model.safetensors").exists()  # an early stop still exports the model
    assert (tmp_path / "a" / "checkpoints" / "step_00000006").exists()
    result = train_in_process(TINY, base(text, tmp_path / "b", "train.eval_every=2", "train.max_steps=40",
                                         "train.early_stopping={divergence_threshold: 0.5}"))
    assert result.steps == 2 and "diverged" in result.stop_reason


def test_keep_best_keeps_the_best_models_by_metric_as_pretrained_dirs(text, tmp_path):
    out = tmp_path / "r"
    train_in_process(TINY, base(text, out, "train.eval_every=2", "checkpoint.keep_best=2",
                                "checkpoint.best_metric=bits_per_char"))
    evals = {r["step"]: r["eval/bits_per_char"] for r in read_metrics(out) if "eval/bits_per_char" in r}
    best_two = sorted(evals, key=evals.get)[:2]
    assert sorted(int(p.name.split("_")[1]) for p in (out / "best").iterdir()) == sorted(best_two)
    from transformers import AutoModelForCausalLM

    step = best_two[0]
    best_dir = out / "best" / f"step_{step:08d}"
    assert json.loads((best_dir / "metrics.json").read_text())["bits_per_char"] == evals[step]
    assert AutoModelForCausalLM.from_pretrained(best_dir).config.model_type == "s4accel-s4"


def test_user_callback_hooks_run_in_order_and_its_state_is_checkpointed(text, tmp_path):
    out, log = tmp_path / "r", tmp_path / "events.jsonl"
    cb = callback_override("testing_callbacks:Recorder", path=str(log))
    result = train_in_process(TINY, base(text, out, cb, "train.eval_every=4", "checkpoint.every_steps=4",
                                         "checkpoint.keep_last=2", "log.log_every=4", "train.max_steps=8"))
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [
        ("train_start", 0), ("log", 4), ("eval", 4), ("save", 4), ("log", 8), ("eval", 8), ("save", 8),
        ("train_end", 8)]
    state = torch.load(result.checkpoint / "custom_checkpoint_2.pkl", weights_only=False)
    assert state == {"steps_seen": 8}
    # Resumed from step 4: the callback's own counter continues from the checkpoint, not from zero.
    train_in_process(TINY, base(text, out, cb, "train.eval_every=4", "checkpoint.every_steps=4", "log.log_every=4",
                                "train.max_steps=10"), resume=str(out / "checkpoints" / "step_00000004"), force=True)
    last = json.loads(log.read_text().splitlines()[-1])
    assert last == {"event": "train_end", "step": 10, "steps_seen": 10}


def test_a_callback_that_cannot_be_imported_fails_before_any_compute(text, tmp_path):
    with pytest.raises(RecipeError, match=r"callbacks.0.target: cannot import 'nowhere.mod:Thing'"):
        train_in_process(TINY, base(text, tmp_path / "r", callback_override("nowhere.mod:Thing")))
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_time_based_checkpoints(text, tmp_path, monkeypatch):
    from s4accel.training import step

    now = [100.0]
    monkeypatch.setattr(step.time, "monotonic", lambda: now[0])
    clock = step.Clock(minutes=0.5)
    now[0] += 29
    assert not clock.due()
    now[0] += 1
    assert clock.due()
    clock.reset()
    assert not clock.due() and not step.Clock(None).due()
    monkeypatch.undo()
    # In a run: with no step interval, checkpoints still come, by time, rotated to keep_last, all complete.
    from s4accel.training.runs.checkpoint import complete_checkpoints

    train_in_process(TINY, base(text, tmp_path / "r", "checkpoint.every_minutes=0.0001", "checkpoint.keep_last=3"))
    saved = sorted((tmp_path / "r" / "checkpoints").iterdir())
    assert 1 <= len(saved) <= 3 and complete_checkpoints(tmp_path / "r") == saved


def test_an_output_directory_that_cannot_be_created_is_one_clear_error(text, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(RunDirError, match=f"cannot write to run directory {blocker / 'run'}"):
        train_in_process(TINY, base(text, blocker / "run"))


def test_endurance_many_checkpoints_bounded_disk_flat_memory(text, tmp_path):
    out = tmp_path / "r"
    train_in_process(TINY, base(text, out, "train.max_steps=150", "train.eval_every=10", "checkpoint.every_steps=2",
                                "checkpoint.keep_last=2", "checkpoint.keep_best=1", "log.log_every=10"))
    assert len(list((out / "checkpoints").iterdir())) == 2  # 75 checkpoints written, the newest 2 kept
    assert len(list((out / "best").iterdir())) == 1
    assert not list(out.rglob(".*tmp*"))
    rss = {r["step"]: r["train/rss_mb"] for r in read_metrics(out) if "train/rss_mb" in r}
    assert rss[150] - rss[30] < 30, rss  # 60 checkpoints and 12 evaluations later, memory has not grown


def test_best_at_end_makes_final_the_best_model_and_the_last_line_says_where_the_best_is(text, tmp_path):
    """What Trainer users know as `load_best_model_at_end`: with `checkpoint.best_at_end`, final/ (what push, eval
    and from_pretrained read) holds the best model's weights, not the last ones. Without it, the last line still says
    where the best model is when final/ is not it."""
    from safetensors.torch import load_file

    steps = ("train.eval_every=2", "train.max_steps=6", "checkpoint.keep_best=1", "checkpoint.best_metric=loss",
             "checkpoint.best_mode=max")  # the highest loss ranks first: the untrained step 2, never the last step
    proc = run_cli("train", TINY, *sets(*base(text, tmp_path / "last", *steps)))
    assert proc.returncode == 0, proc.stderr
    evals = {r["step"]: r["eval/loss"] for r in read_metrics(tmp_path / "last") if "eval/loss" in r}
    best = max(evals, key=evals.get)
    assert best != 6
    line = proc.stdout.strip().splitlines()[-1]
    assert line.endswith(f"; best model (step {best}, loss {evals[best]:.4f}) in "
                         f"{tmp_path / 'last' / 'best' / f'step_{best:08d}'}"), line
    proc = run_cli("train", TINY, *sets(*base(text, tmp_path / "best", *steps, "checkpoint.best_at_end=true")))
    assert proc.returncode == 0, proc.stderr
    final, kept = tmp_path / "best" / "final", tmp_path / "best" / "best" / f"step_{best:08d}"
    a, b = load_file(final / "model.safetensors"), load_file(kept / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    line = proc.stdout.strip().splitlines()[-1]
    assert line.endswith(f"model in {final} (the best: step {best}, loss {evals[best]:.4f})"), line
    from s4accel.config import load_recipe

    with pytest.raises(RecipeError, match="checkpoint.best_at_end: needs checkpoint.keep_best"):
        load_recipe(TINY, ["checkpoint.best_at_end=true", "checkpoint.keep_best=0"])


@pytest.mark.timeout(60)
def test_a_best_model_whose_metrics_file_is_a_fifo_is_passed_over_not_read_forever(tmp_path):
    """`push --best` (and `model.which: best`) read `best/step_*/metrics.json`: a FIFO there blocked forever."""
    import os

    from s4accel.training.callbacks import KeepBest

    for step, loss in ((2, 1.5), (4, 1.2)):
        (tmp_path / "best" / f"step_{step:08d}").mkdir(parents=True)
        (tmp_path / "best" / f"step_{step:08d}" / "metrics.json").write_text(json.dumps({"step": step, "loss": loss}))
    fifo = tmp_path / "best" / "step_00000006"
    fifo.mkdir()
    os.mkfifo(fifo / "metrics.json")
    assert [p.name for _, p in KeepBest(2).ranked(tmp_path)] == ["step_00000004", "step_00000002"]


@pytest.mark.parametrize("override", ["model.overrides={n_layer: 100000}",
                                      "model.lora={r: 10000000, target_modules: [output_linear]}",
                                      "train.grad_accum=100000000"])
def test_a_model_that_cannot_fit_this_machine_is_one_line_before_it_is_built(text, tmp_path, override):
    """`n_layer: 100000` took 91 s and 8.2 GB before an allocator traceback; a LoRA rank of ten million 19 s and
    8.1 GB before a line that named neither. Estimated from the config, refused before anything is allocated."""
    import time

    out = tmp_path / "run"
    start = time.monotonic()
    proc = run_cli("train", TINY, *sets(*base(text, out, override)), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "GB" in lines[0] and "this machine" in lines[0], lines
    assert ("window of micro-batches" if "grad_accum" in override else "parameters") in lines[0], lines
    assert time.monotonic() - start < 60
