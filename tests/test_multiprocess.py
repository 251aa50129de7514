"""Two CPU processes through `accelerate launch` (gloo): the real launch path users take on several GPUs."""

import json

import pytest
import torch

from helpers import (FREE_PORT, REPO, TESTS_ON_PATH, TINY, accelerate_launch, final_weights, read_metrics,
                     short_epochs, small_text_file)

pytestmark = pytest.mark.slow

LAUNCH = [*FREE_PORT, "--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml"]


def launch(*args, timeout=600):
    # PYTHONPATH: for the recipes' testing_callbacks
    return accelerate_launch(*LAUNCH, *args, env=TESTS_ON_PATH, timeout=timeout)


@pytest.mark.parametrize("packed", [False, True], ids=["ragged", "packed-documents"])
def test_two_process_gradients_equal_one_big_batch(packed):
    """Two processes, two micro-batches each: the step's gradient is the whole batch's. With packed documents, it is
    the gradient of every document trained alone."""
    proc = launch(REPO / "tests" / "scripts" / "grad_check.py", *(["packed"] if packed else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["num_processes"] == 2
    assert result["max_rel_diff"] < 1e-5


def test_two_process_training_logs_once_saves_once_and_steps_the_schedule_once_per_step(tmp_path, hf_cache):
    run_dir = tmp_path / "run"
    steps = 8
    proc = launch("-m", "s4accel", "train", TINY, "--set", f"run.out_dir={run_dir}", "--set",
                  f"train.max_steps={steps}", "--set", "checkpoint.every_steps=8", "--set", "log.log_every=1",
                  "--set", "log.progress_bar=false", "--set", "scheduler.name=linear",
                  "--set", "scheduler.warmup_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DDP over 2 processes on cpu" in proc.stdout
    assert proc.stdout.count("done: 8 steps") == 1  # the summary comes from the main process only

    records = read_metrics(run_dir)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))  # logged once per step, not once per process
    # The schedule advanced exactly once per optimizer step: linear warmup 2, then linear decay to 0 at step 8.
    peak = 3e-3
    for r in train:
        s = r["step"]
        expected = peak * (s / 2 if s < 2 else (steps - s) / (steps - 2))
        assert r["train/lr_decay"] == pytest.approx(expected), s
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1

    ckpt = run_dir / "checkpoints" / "step_00000008"
    assert sorted(p.name for p in ckpt.glob("random_states_*")) == ["random_states_0.pkl", "random_states_1.pkl"]
    scheduler_state = torch.load(ckpt / "custom_checkpoint_0.pkl", weights_only=False)
    assert scheduler_state["last_epoch"] == steps
    train_state = torch.load(ckpt / "custom_checkpoint_1.pkl", weights_only=False)
    assert train_state["step"] == steps
    assert train_state["tokens_seen"] == steps * 2 * 8 * 64  # 2 processes x batch 8 x seq_len 64
    assert (run_dir / "final" / "model.safetensors").exists()
    assert not list(run_dir.glob(".*tmp*"))


def test_two_process_run_preempted_on_one_rank_resumes_bit_exactly(tmp_path, hf_cache):
    """SIGTERM reaches rank 1 only: both ranks agree to stop after the next step and save one checkpoint; the resumed
    run (grad_accum 2, mid-epoch, dropout, EMA) ends with the weights of an uninterrupted 2-process run."""
    text = small_text_file(tmp_path)

    def train(out, *extra):
        args = ["-m", "s4accel", "train", TINY]
        for item in short_epochs(text, out, "train.max_steps=12", *extra):
            args += ["--set", item]
        proc = launch(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    train(tmp_path / "ref")
    cut = train(tmp_path / "run", "callbacks=[{target: 'testing_callbacks:SignalAt', args: {step: 7, rank: 1}}]")
    assert "stopped at step 8 (received a stop signal on another process)" in cut.stdout  # rank 0 speaks
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000008" / "custom_checkpoint_1.pkl",
                       weights_only=False)
    assert (state["epoch"], state["batch_in_epoch"]) == (1, 6)  # 10 micro-batches per rank and epoch: 16 = 10 + 6
    args = ["-m", "s4accel", "train", TINY, "--resume"]
    for item in short_epochs(text, tmp_path / "run", "train.max_steps=12"):
        args += ["--set", item]
    proc = launch(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "done: 12 steps" in proc.stdout
    for name in ("final", "final_ema"):
        ref, got = final_weights(tmp_path / "ref", name), final_weights(tmp_path / "run", name)
        assert all(torch.equal(ref[k], got[k]) for k in ref), name


def test_two_process_run_out_of_time_on_one_rank_ends_on_both_at_the_same_step(tmp_path, hf_cache):
    """train.max_time spent on rank 1's clock only (an hour passes there after step 3): both ranks end after step 4
    with an evaluation and final/, and the checkpoint (the main process's counters) records the budget as spent."""
    run_dir = tmp_path / "run"
    proc = launch("-m", "s4accel", "train", TINY, "--set", f"run.out_dir={run_dir}", "--set", "train.max_steps=8",
                  "--set", "train.max_time=1h", "--set", "train.eval_every=0", "--set", "log.progress_bar=false",
                  "--set", "callbacks=[{target: 'testing_callbacks:TimePassesAt', args: {step: 3, seconds: 3600, "
                  "rank: 1}}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: 4 steps") == 1 and "(stopped early: train.max_time 1h reached)" in proc.stdout
    assert [r["step"] for r in read_metrics(run_dir) if "eval/loss" in r] == [4]
    state = torch.load(run_dir / "checkpoints" / "step_00000004" / "custom_checkpoint_1.pkl", weights_only=True)
    assert state["train_seconds"] >= 3600
    assert (run_dir / "final" / "model.safetensors").exists()


def test_two_process_fast_dev_run_passes_and_leaves_nothing(tmp_path, hf_cache):
    """Both processes check the run in the same scratch directory (DDP's gradients, the gathered evaluation, a
    checkpoint of two processes, the export); the main process says so and deletes it."""
    run_dir = tmp_path / "run"
    proc = launch("-m", "s4accel", "train", TINY, "--fast-dev-run", "2", "--set", f"run.out_dir={run_dir}", "--set",
                  "log.progress_bar=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DDP over 2 processes on cpu" in proc.stdout
    assert proc.stdout.count("fast dev run passed in ") == 1 and "2 optimizer steps" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_two_process_classifier_gathers_metrics_over_the_whole_test_split(tmp_path):
    """359 test sequences over 2 processes: gather_for_metrics drops the padded duplicate, so the accuracy the run
    reports equals the exported model's accuracy on the whole split, computed in one process."""
    from transformers import AutoModelForSequenceClassification

    from s4accel.data.arrays import build_array_data
    from s4accel.config import DataCfg

    run_dir = tmp_path / "run"
    proc = launch("-m", "s4accel", "train", REPO / "recipes" / "digits.yaml", "--set", f"run.out_dir={run_dir}",
                  "--set", "model.overrides={d_model: 16, n_layer: 1, d_state: 8, bidirectional: true}",
                  "--set", "train.max_steps=20", "--set", "train.eval_every=0", "--set", "log.progress_bar=false",
                  "--set", "checkpoint.every_steps=0", "--set", "scheduler.warmup_steps=2", "--set", "optim.lr=1e-2",
                  "--set", "data.eval_batch_size=32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reported = [r for r in read_metrics(run_dir) if "eval/accuracy" in r][-1]["eval/accuracy"]
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "final").eval()
    data = build_array_data(DataCfg(source="digits", val_fraction=0.2))
    with torch.no_grad():
        hits = (model(input_values=data.val[:]["input_values"]).logits.argmax(-1) == data.val[:]["labels"]).sum()
    assert len(data.val) == 359  # odd: the second process's last batch is padded with a duplicate
    assert reported == pytest.approx(hits.item() / 359, abs=1e-12)


def test_two_process_moe_run_with_experts_idle_on_one_rank_completes_and_logs_gathered_load(tmp_path, hf_cache):
    """16 experts, top-1, 16 tokens per process and step: most experts get no token on a given rank in a given
    step. DDP must not wait for their gradients (it would raise "Expected to have finished reduction"), and the logged
    load counts both processes' tokens."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(
        "model: {name: moe-tiny, overrides: {num_experts: 16, num_experts_per_tok: 1}}\n"
        "data: {source: files, files: [" + str(small_text_file(tmp_path)) + "], seq_len: 16, batch_size: 1, "
        "val_fraction: 0.1}\n"
        "train: {max_steps: 6, eval_every: 6, eval_max_batches: 2}\n"
        "log: {log_every: 2, progress_bar: false}\n")
    proc = launch("-m", "s4accel", "train", recipe, "--set", f"run.out_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DDP over 2 processes on cpu" in proc.stdout
    train = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    for r in train:
        assert r["moe/routed_pairs"] == 2 * 2 * 16 * 2  # layers x processes x tokens x steps, k = 1
        for layer in range(2):
            assert sum(r[f"moe/load/layer{layer}/expert{e}"] for e in range(16)) == pytest.approx(1.0)
        assert r["train/aux_loss"] > 0 and r["train/balance_loss"] > 0 and r["train/z_loss"] > 0
    assert (run_dir / "final" / "model.safetensors").exists()
