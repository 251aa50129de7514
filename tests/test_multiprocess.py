"""Two CPU processes through `accelerate launch` (gloo): the real launch path users take on several GPUs."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY

pytestmark = pytest.mark.slow

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          str(REPO / "accelerate_configs" / "cpu_2proc.yaml")]


def launch(*args, timeout=600):
    return subprocess.run([*LAUNCH, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_two_process_gradients_equal_one_big_batch():
    proc = launch(REPO / "tests" / "scripts" / "grad_check.py")
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
    assert "2 process(es)" in proc.stdout
    assert proc.stdout.count("done: 8 steps") == 1  # the summary comes from the main process only

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
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
