"""The CLI end to end on the tiny recipe, in a subprocess as a user runs it; and the Python API without the CLI."""


import re
import shlex
from pathlib import Path

import pytest
import yaml

from helpers import TESTS_ON_PATH, TINY, read_metrics, run_cli, sets, small_text_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, hf_cache):
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    proc = run_cli("train", TINY, "--set", f"run.out_dir={run_dir}", "--set", "train.max_steps=10",
                   "--set", "checkpoint.every_steps=5", "--set", "log.progress_bar=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_run_directory_holds_recipe_metrics_tensorboard_checkpoint_and_model(finished_run):
    run_dir, proc = finished_run
    assert "done: 10 steps" in proc.stdout
    # the first line says how the run is spread in a user's words, not Accelerate's enum ("1 process(es) ... (NO)")
    assert "val tokens, single process on cpu, mixed precision no" in proc.stdout.splitlines()[0], proc.stdout
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert recipe["train"]["max_steps"] == 10 and recipe["run"]["out_dir"] == str(run_dir)
    records = read_metrics(run_dir)
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [5, 10]
    for key in ("train/grad_norm", "train/tokens_per_s", "train/step_time_ms", "train/peak_mem_mb",
                "train/lr_ssm", "train/lr_decay", "train/lr_no_decay"):
        assert key in records[0], key
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [10]
    assert {"eval/ppl", "eval/bits_per_byte", "eval/bits_per_char"} <= set(evals[0])
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(events[0]))
    tb.Reload()
    assert [(s.step, round(s.value, 5)) for s in tb.Scalars("train/loss")] == [
        (r["step"], round(r["train/loss"], 5)) for r in records if "train/loss" in r]
    assert [s.step for s in tb.Scalars("eval/bits_per_char")] == [10]
    # keep_last=1: only the newest complete checkpoint remains, no temporary directory
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000010"]
    assert (run_dir / "checkpoints" / "step_00000010" / "COMPLETE").exists()
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"):
        assert (run_dir / "final" / name).exists(), name
    assert (run_dir / "samples.txt").read_text().startswith("--- sample 0\nROMEO.")


def test_final_model_loads_with_auto_classes_and_generates(finished_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import s4accel  # noqa: F401  (registers the Auto classes)

    run_dir, _ = finished_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tok = AutoTokenizer.from_pretrained(run_dir / "final")
    ids = tok("KING.", return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8)
    assert tok.decode(out[0]).startswith("KING.")  # the prompt decodes back, then the 8 new tokens
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_rerun_into_a_finished_run_is_refused_unless_overwrite(finished_run):
    run_dir, _ = finished_run
    proc = run_cli("train", TINY, "--set", f"run.out_dir={run_dir}", "--set", "train.max_steps=2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {run_dir} already holds a run (final, checkpoints, metrics.jsonl, tensorboard, samples.txt, "
        f"train.log); "
        "resume it with --resume, choose another run.name or run.out_dir, set run.version=number to give each "
        "new run a folder of its own, or set run.overwrite=true to replace it"]
    assert (run_dir / "final" / "model.safetensors").exists()  # untouched


@pytest.mark.parametrize("how", ["number", "time"])
def test_the_same_command_again_trains_into_a_new_folder_with_run_version_and_resume_continues_the_newest(
        tmp_path, text, how):
    """The habit of running a command again: `run.version` gives each new run its own folder under runs/ (`name`,
    `name-1`, ... or `name-<time>`), while a bare rerun without it is still refused (above)."""
    import re
    import time

    command = ["train", TINY, *sets("run.name=exp", f"run.version={how}", "data.source=files", f"data.files=[{text}]",
                                    "train.max_steps=2", "train.eval_every=0", "checkpoint.every_steps=1",
                                    "sample.prompts=[]", "log.progress_bar=false")]
    made = []
    for _ in range(2):
        proc = run_cli(*command, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        made.append(proc.stdout.strip().splitlines()[-1].rsplit(" in ", 1)[1])
        time.sleep(1.1)  # a new second: `time` names folders by it
    runs = tmp_path / "runs"
    if how == "number":
        assert made == [str(Path("runs") / "exp" / "final"), str(Path("runs") / "exp-1" / "final")]
    else:
        assert all(re.fullmatch(r"runs/exp-\d{8}-\d{6}/final", m) for m in made) and made[0] != made[1]
    newest = runs / Path(made[1]).parent.name
    proc = run_cli(*command, "--resume", *sets("train.max_steps=3"), "--force", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("done: 3 steps")
    assert sorted(p.name for p in runs.iterdir()) == sorted(Path(m).parent.name for m in made)  # no third folder
    assert (newest / "checkpoints" / "step_00000003").is_dir()


def test_missing_data_file_is_one_line_before_training(tmp_path):
    proc = run_cli("train", TINY, "--set", f"run.out_dir={tmp_path / 'r'}", "--set", "data.source=files",
                   "--set", f"data.files=[{tmp_path / 'missing.txt'}]")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: data.files: no such file: {tmp_path / 'missing.txt'}"
    assert "Traceback" not in proc.stderr


def test_python_api_trains_without_the_cli(tmp_path, hf_cache):
    import s4accel

    recipe = s4accel.load_recipe(TINY, [f"run.out_dir={tmp_path / 'api'}", "train.max_steps=4",
                                        "train.eval_every=0", "checkpoint.every_steps=0", "log.log_with=[]",
                                        "log.progress_bar=false", "sample.prompts=[]"])
    result = s4accel.train(recipe)
    assert result.steps == 4 and result.final_dir == tmp_path / "api" / "final"
    assert set(result.eval_metrics) == {"loss", "ppl", "bits_per_byte", "bits_per_char"}
    assert result.eval_metrics["bits_per_byte"] < 8.5  # 259-way uniform is 8.02 bits; 4 steps already learn a bit
    assert not (tmp_path / "api" / "metrics.jsonl").exists()


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


@pytest.mark.parametrize("typed, worker", [
    (["launch", "--config_file", "c.yaml", "train", "run", "--resume"], ["train", "run", "--resume=latest"]),
    (["launch", "train", "run"], ["train", "run"]),
])
def test_the_continue_command_under_s4accel_launch_is_its_own_command_line(tmp_path, monkeypatch, typed, worker):
    """The command printed after a stop is the launcher's command line as typed (a config file made absolute), with
    `train RUN --resume`; `s4accel launch` hands its workers `--resume=latest` for a bare `--resume`."""
    import subprocess
    import sys
    import time

    from s4accel.tools.launcher import launcher_command

    (tmp_path / "c.yaml").write_text("{}")
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *typed], cwd=tmp_path)
    try:
        time.sleep(0.5)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("os.getppid", lambda: parent.pid)
        command = launcher_command(worker)
    finally:
        parent.kill()
    expected = ["launch", "--config_file", str(tmp_path / "c.yaml")] if "c.yaml" in typed else ["launch"]
    assert command == [sys.executable, "-c", "import time; time.sleep(60)", *expected]
