"""What a Lightning / HF Trainer user expects on day one: the command printed after Ctrl-C resumes the same run, a
launch that cannot use its topology says so, and the console shows no library noise."""

import json
import os
import re
import shlex

from helpers import REPO, TINY, read_metrics, run_cli, small_text_file

TESTS_ON_PATH = {"PYTHONPATH": str(REPO / "tests")}  # for testing_callbacks


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def test_the_command_printed_after_ctrl_c_resumes_the_same_run_from_anywhere(tmp_path):
    text = small_text_file(tmp_path)
    # Started with --set items that move the run directory: the printed command must not depend on them.
    out = tmp_path / "elsewhere" / "my-run"
    proc = run_cli("train", TINY, *sets(
        f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "train.max_steps=8",
        "checkpoint.every_steps=100", "log.progress_bar=false", "log.log_every=1", "sample.prompts=[]",
        "callbacks=[{target: 'testing_callbacks:SignalAt', args: {step: 3, signal_name: SIGINT}}]"),
        env=TESTS_ON_PATH, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    command = re.search(r"continue with: (.+)", proc.stdout).group(1)
    args = shlex.split(command)
    assert args[:2] == ["s4accel", "train"] and args[-1] == "--resume"
    other = tmp_path / "another-folder"
    other.mkdir()
    resumed = run_cli(*args[1:], env=TESTS_ON_PATH, cwd=other)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "done: 8 steps" in resumed.stdout
    steps = [r["step"] for r in read_metrics(out) if "train/loss" in r]
    assert steps == list(range(1, 9))  # one run, continued from step 3, never restarted
    assert not (other / "runs").exists() and (out / "final" / "model.safetensors").is_file()


def test_resume_that_finds_no_checkpoint_says_so_in_one_line(tmp_path):
    text = small_text_file(tmp_path)
    proc = run_cli("train", TINY, "--resume", *sets(
        f"run.out_dir={tmp_path / 'fresh'}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
        "train.max_steps=2", "log.progress_bar=false", "sample.prompts=[]"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert f"--resume: no checkpoint in {tmp_path / 'fresh'}" in said and "starting a fresh run" in said


def test_a_directory_without_a_recipe_is_one_line(tmp_path):
    proc = run_cli("train", tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "is a directory without a recipe.yaml" in proc.stderr


def test_more_processes_than_cores_without_a_gpu_is_a_warning(monkeypatch):
    from types import SimpleNamespace

    from s4accel.training.loop import setup_warnings

    cores = len(os.sched_getaffinity(0))
    cpu = SimpleNamespace(device=SimpleNamespace(type="cpu"), num_processes=cores + 6, mixed_precision="bf16",
                          distributed_type=SimpleNamespace(value="MULTI_CPU"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 6))  # what `accelerate launch` sets for each process
    (said,) = setup_warnings(cpu)
    assert said.startswith(f"{cores + 6} processes on {cores} CPU cores and no GPU") and "--num_processes" in said
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert setup_warnings(cpu) == []  # one process per core is what the CPU configs do
    gpu = SimpleNamespace(**{**vars(cpu), "device": SimpleNamespace(type="cuda")})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 6))
    assert setup_warnings(gpu) == []


NOISE = ("Removed shared tensor", "Writing model shards", "Loading weights", "dropping empty documents", "tokenizing",
         "Downloading data", "Generating train split")


def test_a_run_and_eval_print_no_library_noise(tmp_path):
    bars_as_users_have_them = {"HF_DATASETS_DISABLE_PROGRESS_BARS": None}  # the test session turns them off
    text = small_text_file(tmp_path)
    data = tmp_path / "docs.jsonl"  # a local file datasets reads with its json builder
    data.write_text("\n".join(json.dumps({"text": text.read_text()[i: i + 500]}) for i in range(0, 3000, 500)))
    common = sets(f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{data}]",
                  "data.seq_len=32", "log.progress_bar=false", "sample.prompts=[]")
    proc = run_cli("train", TINY, *common, *sets("train.max_steps=4", "checkpoint.every_steps=2",
                                                 "train.eval_every=2"), env=bars_as_users_have_them)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert "done: 4 steps" in said and not [n for n in NOISE if n in said], said
    scored = run_cli("eval", tmp_path / "run", TINY, *common, env=bars_as_users_have_them)
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert "loss" in scored.stdout and not [n for n in NOISE if n in scored.stdout + scored.stderr], scored.stderr


def test_printed_samples_carry_no_raw_control_bytes():
    from s4accel.training.samples import printable

    sample = "ROMEO.\n\tAy\x1b[2J\rme\x07"
    shown = printable(sample)
    assert shown == "ROMEO.\n\tAy\\x1b[2J\\rme\\x07"
    assert not any(ord(c) < 32 and c not in "\n\t" for c in shown)


def test_datasets_bars_show_only_for_data_that_takes_a_while(monkeypatch):
    import datasets

    import importlib

    bars = importlib.import_module("datasets.utils.tqdm")  # the module (the package re-exports a class of that name)
    monkeypatch.setattr(bars, "HF_DATASETS_DISABLE_PROGRESS_BARS", None)  # as users have them
    from s4accel.data.progress import BIG, bars_for

    datasets.enable_progress_bars()
    with bars_for(38):
        assert not datasets.is_progress_bar_enabled()
    assert datasets.is_progress_bar_enabled()  # restored
    with bars_for(BIG), bars_for(None):
        assert datasets.is_progress_bar_enabled()


def test_epoch_hooks_run_at_each_pass_over_the_data(tmp_path):
    from helpers import callback_override, short_epochs, train_in_process

    text, log = small_text_file(tmp_path), tmp_path / "epochs.jsonl"
    train_in_process(TINY, short_epochs(text, tmp_path / "run", "train.max_steps=24", "checkpoint.every_steps=100",
                                        callback_override("testing_callbacks:EpochRecorder", path=str(log))))
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["event"], e["epoch"]) for e in events] == [
        ("epoch_start", 0), ("epoch_end", 0), ("epoch_start", 1), ("epoch_end", 1), ("epoch_start", 2)]
    per_epoch = {e["batches"] for e in events if e["event"] == "epoch_end"}
    assert len(per_epoch) == 1 and per_epoch.pop() > 0  # every micro-batch of the pass was consumed
    assert all(e["batches"] == 0 for e in events if e["event"] == "epoch_start")


def test_a_method_named_like_a_hook_that_is_not_one_is_a_recipe_error(tmp_path):
    text = small_text_file(tmp_path)
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{text}]",
                                        "callbacks=[{target: 'testing_callbacks:LightningNamed'}]"), env=TESTS_ON_PATH)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "LightningNamed.on_train_epoch_end is not a hook" in proc.stderr
    assert "did you mean on_epoch_end?" in proc.stderr
    assert not (tmp_path / "run").exists()
