"""Never lose a run: a preempted or killed run resumes exactly, and a resume with a changed recipe is refused."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import (REPO, TINY, callback_override, final_weights, read_metrics, short_epochs,
                      train_in_process)
from s4accel.errors import ResumeError

pytestmark = pytest.mark.slow

STEPS = 24  # short_epochs' train.max_steps


def assert_same_weights(dir_a, dir_b, name="final"):
    a, b = final_weights(dir_a, name), final_weights(dir_b, name)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{name}/{k} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text):
    """The uninterrupted run every interrupted one must end equal to."""
    out = tmp_path_factory.mktemp("ref") / "run"
    result = train_in_process(TINY, short_epochs(text, out))
    assert result.steps == STEPS and not result.preempted
    return out


def test_sigterm_mid_epoch_saves_within_one_step_and_resume_is_bit_exact(reference, text, tmp_path):
    out = tmp_path / "run"
    cut = train_in_process(TINY, short_epochs(text, out, callback_override("testing_callbacks:SignalAt", step=13)))
    # The signal arrived after step 13: step 14 completes, is checkpointed, and the run returns without exporting.
    assert cut.preempted and cut.steps == 14 and cut.stop_reason == "received SIGTERM"
    assert cut.checkpoint == out / "checkpoints" / "step_00000014" and cut.final_dir is None
    assert not (out / "final").exists()
    state = torch.load(cut.checkpoint / "custom_checkpoint_1.pkl", weights_only=False)
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 8)  # 28 micro-batches: one epoch of 20, then 8

    resumed = train_in_process(TINY, short_epochs(text, out), resume="latest")
    assert resumed.steps == STEPS and resumed.stop_reason is None
    assert_same_weights(reference, out)
    assert_same_weights(reference, out, "final_ema")
    steps = [r["step"] for r in read_metrics(out) if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1))  # each step logged once: records past the checkpoint were dropped
    evals = lambda d: [(r["step"], r["eval/loss"], r["eval_ema/loss"]) for r in read_metrics(d) if "eval/loss" in r]
    assert evals(out) == evals(reference)


def test_train_resume_auto_starts_fresh_then_the_same_call_continues_and_resume_given_wins(reference, text, tmp_path,
                                                                                         capsys):
    """What a launcher that restarts its job (torchrun --max-restarts, SLURM --requeue) relies on: one command for
    the first start and every restart."""
    out = tmp_path / "run"
    auto = short_epochs(text, out, "train.resume=auto")
    cut = train_in_process(TINY, [*auto, callback_override("testing_callbacks:SignalAt", step=13)])
    assert cut.preempted and cut.steps == 14
    assert "no checkpoint" not in capsys.readouterr().out  # a new run starts fresh without a word
    resumed = train_in_process(TINY, auto)
    assert resumed.steps == STEPS and f"resumed from {out / 'checkpoints' / 'step_00000014'} at step 14" in \
        capsys.readouterr().out
    assert_same_weights(reference, out)
    older = out / "checkpoints" / "step_00000020"  # the newest is step 24: an explicit resume wins over auto
    train_in_process(TINY, auto, resume=str(older))
    assert f"resumed from {older} at step 20" in capsys.readouterr().out
    assert_same_weights(reference, out)


def test_a_run_stopped_during_its_last_evaluation_evaluates_when_resumed(reference, text, tmp_path):
    """The signal after the last step cuts its evaluation short and the checkpoint holds the finished training: the
    resumed run has no step left to take, and still ends with that evaluation (as the uninterrupted run did)."""
    out = tmp_path / "run"
    cut = train_in_process(TINY, short_epochs(text, out, callback_override("testing_callbacks:SignalAt", step=STEPS)))
    evals = lambda run: [(r["step"], r["eval/loss"]) for r in read_metrics(run) if "eval/loss" in r]
    assert cut.preempted and cut.steps == STEPS and [step for step, _ in evals(out)] == [8, 16]
    resumed = train_in_process(TINY, short_epochs(text, out), resume="latest")
    assert resumed.steps == STEPS and resumed.final_dir == out / "final"
    assert evals(out) == evals(reference) and resumed.eval_metrics["loss"] == evals(reference)[-1][1]
    assert_same_weights(reference, out)


def test_max_time_ends_the_run_with_its_model_and_a_larger_budget_continues_it_exactly(reference, text, tmp_path):
    """Lightning's max_time: the budget runs out during step 11 (an hour passes after step 10, counted without
    waiting for it), and the run ends after that step as at max_steps: an evaluation, a checkpoint, final/. Resumed
    with its budget spent, it is refused before anything is built; with a larger one it ends on the uninterrupted
    run's weights."""
    out = tmp_path / "run"
    an_hour = callback_override("testing_callbacks:TimePassesAt", step=10, seconds=3600)
    ended = train_in_process(TINY, short_epochs(text, out, "train.max_time=1h", an_hour))
    assert ended.steps == 11 and not ended.preempted and ended.stop_reason == "train.max_time 1h reached"
    assert ended.final_dir == out / "final" and (out / "final" / "model.safetensors").exists()
    assert ended.checkpoint == out / "checkpoints" / "step_00000011"
    assert [r["step"] for r in read_metrics(out) if "eval/loss" in r] == [8, 11]  # due at 8, then the last step
    state = torch.load(ended.checkpoint / "custom_checkpoint_1.pkl", weights_only=True)
    assert 3600 < state["train_seconds"] < 3600 + 300  # the hour, and the loop's own few seconds
    with pytest.raises(ResumeError, match=r"^train.max_time 1h is spent: the run trained 1h[\dms]* to step 11; "
                                          r"raise it to train on \(--set train.max_time=2h\)$"):
        train_in_process(TINY, short_epochs(text, out, "train.max_time=1h"), resume="latest")
    resumed = train_in_process(TINY, short_epochs(text, out, "train.max_time=01:30:00"), resume="latest")
    assert resumed.steps == STEPS and resumed.stop_reason is None
    assert_same_weights(reference, out)


def test_resume_with_a_changed_recipe_is_refused_with_a_diff_unless_forced(reference, text, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)  # the reference stays as it is for the other tests
    changed = short_epochs(text, run, "optim.lr=0.001", "log.log_every=2")  # log.* may change freely
    with pytest.raises(ResumeError) as info:
        train_in_process(TINY, changed, resume="latest")
    assert str(info.value).splitlines()[1:] == ["  optim.lr: 0.003 -> 0.001"]
    result = train_in_process(TINY, [*changed, "train.max_steps=26"], resume="latest", force=True)
    assert result.steps == 26  # continued from step 20, the newest checkpoint


def test_cli_resume_flag_forms_and_missing_checkpoint(tmp_path):
    from s4accel.cli import bare_resume_to_latest

    assert bare_resume_to_latest(["train", "r.yaml", "--resume"]) == ["train", "r.yaml", "--resume=latest"]
    assert bare_resume_to_latest(["train", "--resume", "r.yaml"]) == ["train", "--resume=latest", "r.yaml"]
    assert bare_resume_to_latest(["train", "r.yaml", "--resume", "--force"])[2] == "--resume=latest"
    assert bare_resume_to_latest(["train", "r.yaml", "--resume", "ck/step_5"])[2:] == ["--resume", "ck/step_5"]
    from helpers import run_cli

    proc = run_cli("train", TINY, "--set", f"run.out_dir={tmp_path / 'r'}", "--resume", tmp_path / "nope")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: --resume {tmp_path / 'nope'}: not a usable checkpoint: no such checkpoint"


def test_sigkill_at_random_moments_then_resume_ends_equal_to_the_uninterrupted_run(reference, text, tmp_path):
    """Kill -9 the CLI at random moments (every step writes a checkpoint, so many kills land inside a save), resume
    with --resume each time, and finish: the final weights equal the uninterrupted run's."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "s4accel", "train", str(TINY), "--resume"]
    for item in short_epochs(text, out, "checkpoint.every_steps=1", "checkpoint.keep_last=2"):
        args += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    rng = random.Random(0)
    kills = 0
    while kills < 4:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
        start_step = _newest_step(out)
        deadline = time.monotonic() + 120
        while _newest_step(out) <= start_step and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # wait until this process has made progress ...
        if proc.poll() is not None:
            break  # finished before we could kill it
        time.sleep(rng.uniform(0.0, 0.12))  # ... then kill it at a random moment of its next steps and saves
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= 3, "the run finished too fast to be killed"
    final = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert f"done: {STEPS} steps" in final.stdout
    assert_same_weights(reference, out)
    assert_same_weights(reference, out, "final_ema")
    assert len(list((out / "checkpoints").glob("step_*"))) == 2
    assert not list((out / "checkpoints").glob(".tmp_*"))


def _newest_step(run_dir):
    names = sorted((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else []
    return int(names[-1].name.split("_")[1]) if names else -1


class _Payload:
    """Unpickling this runs code (creates a file): what a tampered checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_whose_state_would_run_code_is_refused_unread(reference, text, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    target = next(ckpt.glob("custom_checkpoint_*.pkl"))
    marker = tmp_path / "code-ran"
    torch.save({"step": 3, "evil": _Payload(str(marker))}, target)
    import json

    from s4accel.training.runs.checkpoint import COMPLETE

    manifest = json.loads((ckpt / COMPLETE).read_text())  # keep it "complete": only its content is tampered with
    manifest["files"][target.name] = target.stat().st_size
    (ckpt / COMPLETE).write_text(json.dumps(manifest))
    with pytest.raises(ResumeError, match="refusing to unpickle"):
        train_in_process(TINY, short_epochs(text, run), resume=str(ckpt))
    assert not marker.exists()


@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_resume_is_bit_exact_on_each_s4_convolution_path(path, text, tmp_path):
    """The chunked form as batched matmuls and as the fused kernels (run by Triton's interpreter without a GPU)
    resume as exactly as the FFT path: a run stopped mid-epoch ends equal to the uninterrupted one."""
    # 12 steps, not 24: Triton's interpreter runs the fused kernels slowly; an evaluation (step 8) and a checkpoint
    # (step 5) come before the stop, as in the longer runs
    overrides = [f"model.overrides={{dropout: 0.1, conv_path: {path}, d_state: 32, d_model: 4, n_layer: 1}}",
                 "train.max_steps=12"]
    reference = tmp_path / "reference"
    train_in_process(TINY, short_epochs(text, reference, *overrides))
    assert f"S4 convolution: {path}" in (reference / "train.log").read_text()
    out = tmp_path / "run"
    cut = train_in_process(TINY, short_epochs(text, out, *overrides,
                                              callback_override("testing_callbacks:SignalAt", step=9)))
    assert cut.preempted and cut.steps == 10
    resumed = train_in_process(TINY, short_epochs(text, out, *overrides), resume="latest")
    assert resumed.steps == 12
    assert_same_weights(reference, out)
    assert_same_weights(reference, out, "final_ema")


def test_a_run_stopped_during_an_evaluation_mid_run_does_it_first_when_resumed(reference, text, tmp_path):
    """The signal after step 8 cuts that step's evaluation short; the checkpoint at step 8 says so, and the resumed
    run evaluates before step 9: the same evaluations, EMA ones included, as the uninterrupted run, and its weights."""
    out = tmp_path / "run"
    cut = train_in_process(TINY, short_epochs(text, out, callback_override("testing_callbacks:SignalAt", step=8)))
    evals = lambda d: [(r["step"], r["eval/loss"], r["eval_ema/loss"]) for r in read_metrics(d) if "eval/loss" in r]
    assert cut.preempted and cut.steps == 8 and evals(out) == []
    resumed = train_in_process(TINY, short_epochs(text, out), resume="latest")
    assert resumed.steps == STEPS and evals(out) == evals(reference)
    assert_same_weights(reference, out)
