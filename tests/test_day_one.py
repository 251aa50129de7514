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
        ("epoch_start", 0), ("epoch_end", 0), ("epoch_start", 1), ("epoch_end", 1), ("epoch_start", 2),
        ("train_end", 2)]
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


def rates(make_schedule, steps, bases=(1e-2, 3e-3)):
    """Each step's learning rate of two parameter groups under the schedule `make_schedule(optimizer)`."""
    import torch

    opt = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": b} for b in bases])
    sched = make_schedule(opt)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def lrs_of(name, kwargs, warmup, steps):
    from s4accel.config.schema import SchedulerCfg
    from s4accel.training.optim import build_scheduler

    cfg = SchedulerCfg(name=name, warmup_steps=warmup, kwargs=kwargs)
    return rates(lambda opt: build_scheduler(opt, cfg, warmup, steps), steps)


def torch_lrs(cls, kwargs, steps):
    return rates(lambda opt: cls(opt, **kwargs), steps)


def test_torch_schedules_follow_torchs_own_classes_after_a_linear_warmup():
    import pytest
    import torch

    warmup, steps = 4, 40
    cases = [("step", {"step_size": 7, "gamma": 0.5}, torch.optim.lr_scheduler.StepLR, {"step_size": 7, "gamma": 0.5}),
             ("exponential", {"gamma": 0.9}, torch.optim.lr_scheduler.ExponentialLR, {"gamma": 0.9}),
             ("cosine_annealing", {"eta_min": 1e-4}, torch.optim.lr_scheduler.CosineAnnealingLR,
              {"T_max": steps - warmup, "eta_min": 1e-4})]
    for name, kwargs, cls, torch_kwargs in cases:
        ours = lrs_of(name, kwargs, warmup, steps)
        assert ours[:warmup] == [[b * s / warmup for b in (1e-2, 3e-3)] for s in range(warmup)]
        theirs = torch_lrs(cls, torch_kwargs, steps - warmup)
        assert sum(ours[warmup:], []) == pytest.approx(sum(theirs, []), rel=1e-9), name
    halving = lrs_of("lambda", {"target": "testing_tasks:halve_every_3"}, 0, 9)
    assert [row[0] for row in halving] == pytest.approx([1e-2] * 3 + [5e-3] * 3 + [2.5e-3] * 3)


def test_torch_schedule_arguments_are_checked_before_any_compute(tmp_path):
    for kwargs, says in [("{gamma: 0.5}", "missing step_size for step"),
                         ("{step_size: 5, gama: 0.5}", "unknown gama for step"),
                         ("{step_size: 0}", "step_size and T_max must be at least 1")]:
        proc = run_cli("show", TINY, *sets("scheduler.name=step", f"scheduler.kwargs={kwargs}"))
        assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_torch_schedule_is_checkpointed_and_a_resumed_run_follows_it(tmp_path):
    import pytest

    from helpers import short_epochs, train_in_process

    text = small_text_file(tmp_path)
    sched = ["scheduler.name=step", "scheduler.kwargs={step_size: 3, gamma: 0.5}", "scheduler.warmup_steps=2",
             "train.max_steps=12"]
    whole = train_in_process(TINY, short_epochs(text, tmp_path / "whole", *sched))
    lrs = {r["step"]: r["train/lr_decay"] for r in read_metrics(whole.run_dir) if "train/lr_decay" in r}
    lr = 3e-3  # the tiny recipe's optim.lr; logged after step s: the rate of step s + 1, lr * f(s)
    expected = {s: lr * (s / 2 if s < 2 else 0.5 ** ((s - 2) // 3)) for s in range(1, 13)}
    assert lrs == pytest.approx(expected, rel=1e-6)
    cut = tmp_path / "cut"
    train_in_process(TINY, short_epochs(text, cut, *sched[:-1], "train.max_steps=5"))
    resumed = train_in_process(TINY, short_epochs(text, cut, *sched), resume="latest", force=True)
    again = {r["step"]: r["train/lr_decay"] for r in read_metrics(resumed.run_dir) if "train/lr_decay" in r}
    assert {s: again[s] for s in range(6, 13)} == {s: lrs[s] for s in range(6, 13)}


def test_everything_the_run_prints_is_in_train_log_too(tmp_path):
    text = small_text_file(tmp_path)
    run = tmp_path / "run"
    proc = run_cli("train", TINY, *sets(f"run.out_dir={run}", "data.source=files", f"data.files=[{text}]",
                                        "data.seq_len=32", "train.max_steps=4", "train.eval_every=2",
                                        "checkpoint.every_steps=2", "train.mixed_precision=fp16"))  # fp16 on CPU warns
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (run / "train.log").read_text()
    assert "CausalLMTask" in log and "step 2: loss" in log and "step 4: loss" in log and "--- sample" in log
    assert "fp16 mixed precision has no effect on CPU" in log
    assert "\r" not in log and "it/s" not in log  # no progress-bar redraws
    assert "\x1b" not in log and "\n\n\n" not in log  # nor the evaluation bar's cursor moves and line feeds
    assert log.splitlines()[-1].startswith("done: 4 steps")  # the command's summary line too
    first = log
    resumed = run_cli("train", run, "--resume", "--set", "train.max_steps=6", "--force")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = (run / "train.log").read_text()
    assert log.startswith(first) and "step 6: loss" in log  # a resumed run appends


def test_train_log_prefixes_the_other_processes_stderr_with_their_rank(tmp_path):
    from s4accel.training.console import RunLog

    log = RunLog()
    log.begin(is_main=False, rank=1)
    try:
        log.add("warning: early\n", "stderr")  # before the run directory exists: kept
        log.add("printed\n", "stdout")  # the main process prints the run's lines
        log.add("\rtrain:  50%|#####     |", "stderr")
        log.open(tmp_path / "train.log")
        log.add("warning: later\n", "stderr")
    finally:
        log.end()
    assert (tmp_path / "train.log").read_text() == "[rank 1] warning: early\n[rank 1] warning: later\n"


def test_max_epochs_trains_whole_passes_and_the_schedule_spans_them(tmp_path):
    from helpers import callback_override, short_epochs, train_in_process

    text, log = small_text_file(tmp_path), tmp_path / "epochs.jsonl"
    # 20 micro-batches per pass, grad_accum 2: two passes are 20 optimizer steps, with no max_steps given
    result = train_in_process(TINY, short_epochs(text, tmp_path / "run", "train.max_steps=null", "train.max_epochs=2",
                                                 "checkpoint.every_steps=100",
                                                 callback_override("testing_callbacks:EpochRecorder", path=str(log))))
    assert result.steps == 20 and result.stop_reason is None
    events = [json.loads(line) for line in log.read_text().splitlines()]
    # the second pass ends with the run's last step: its hook runs (before training ends) though no batch of a third
    # pass was drawn
    assert [(e["event"], e["epoch"]) for e in events] == [
        ("epoch_start", 0), ("epoch_end", 0), ("epoch_start", 1), ("epoch_end", 1), ("train_end", 1)]
    lrs = [r["train/lr_decay"] for r in read_metrics(tmp_path / "run") if "train/lr_decay" in r]
    assert len(lrs) == 20 and lrs[-1] < 0.05 * max(lrs)  # the cosine reaches its end at the last step, not at 1000


def test_max_epochs_rounds_up_to_whole_windows_and_max_steps_caps_it(tmp_path):
    from helpers import short_epochs, train_in_process

    text = small_text_file(tmp_path)
    # 2 passes of 20 micro-batches in windows of 3: 14 steps (the last window takes 2 micro-batches of a third pass)
    result = train_in_process(TINY, short_epochs(text, tmp_path / "a", "train.max_steps=null", "train.max_epochs=2",
                                                 "train.grad_accum=3", "checkpoint.every_steps=100"))
    assert result.steps == 14
    result = train_in_process(TINY, short_epochs(text, tmp_path / "b", "train.max_steps=6", "train.max_epochs=2",
                                                 "checkpoint.every_steps=100"))
    assert result.steps == 6  # whichever ends first


def test_max_epochs_counts_the_batches_each_process_draws():
    """Under `accelerate launch` the sharded loader deals batches out in turn: the steps follow from each process's
    share, as Accelerate's own sharding counts it."""
    import torch
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import DataLoader

    from s4accel.config import load_recipe
    from s4accel.training.plan import make_plan

    for rows, drop_last, processes in [(37, False, 2), (37, True, 2), (40, False, 2), (41, False, 3), (29, True, 3)]:
        loader = DataLoader(torch.arange(rows), batch_size=4, drop_last=drop_last)
        recipe = load_recipe(TINY, ["train.max_steps=null", "train.max_epochs=1", "scheduler.warmup_steps=0"])
        plan = make_plan(recipe, loader, processes, sharded=True)
        shard = BatchSamplerShard(loader.batch_sampler, num_processes=processes, process_index=0, even_batches=True)
        assert plan.total_steps == len(shard) == plan.batches_per_epoch, (rows, drop_last, processes)


def test_max_epochs_is_refused_before_compute_where_there_are_no_epochs(tmp_path):
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run'}", "data.streaming=true",
                                        "train.max_epochs=2"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "train.max_epochs: a streamed source" in proc.stderr and "set train.max_steps" in proc.stderr
    # warmup longer than the passes: one line, once the passes are counted (still before any step)
    text = small_text_file(tmp_path)
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run2'}", "data.source=files",
                                        f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4",
                                        "train.max_steps=null", "train.max_epochs=1", "scheduler.warmup_steps=500"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "scheduler.warmup_steps: 500 warmup steps are more than the" in proc.stderr
    assert "train.max_epochs=1" in proc.stderr and not (tmp_path / "run2").exists()


def test_show_prints_a_per_layer_summary_whose_top_rows_add_up():
    import yaml

    proc = run_cli("show", TINY)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["model"]["name"] == "s4-tiny"  # still YAML: the table is comments
    rows = [line[2:] for line in proc.stdout.splitlines() if line.startswith("# ") and not line.startswith("# model")]
    assert rows[0].split() == ["layer", "type", "parameters"]
    table = {r.split()[0]: (r.split()[1], int(r.split()[2].replace(",", ""))) for r in rows[1:]}
    assert table["backbone.layers.0"] == ("S4Block", 10_624) and table["backbone.layers.1"] == ("S4Block", 10_624)
    assert "backbone.layers" not in table  # a container is no level: its blocks are
    top = [r for r in rows[1:] if not r.startswith(" ")]
    assert sum(int(r.split()[2].replace(",", "")) for r in top) == 37_952  # the total on the last line
    lm_head = next(r for r in rows if r.startswith("lm_head"))
    assert "(shares backbone.embeddings.weight)" in lm_head  # tied to the input embedding, counted once

    deeper = run_cli("show", TINY, "--depth", "3").stdout
    assert "backbone.layers.0.layer " in deeper and "backbone.layers.0.layer " not in proc.stdout
    assert not any(line.startswith("# layer") for line in run_cli("show", TINY, "--depth", "0").stdout.splitlines())


def test_profile_traces_the_chosen_steps_into_the_run_directory(tmp_path):
    from helpers import short_epochs, train_in_process

    text = small_text_file(tmp_path)
    run = tmp_path / "run"
    train_in_process(TINY, short_epochs(text, run, "train.max_steps=7", "checkpoint.every_steps=100",
                                        "train.profile={wait: 2, warmup: 1, active: 2}"))
    traces = list((run / "profile").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#3", "ProfilerStep#4"]  # optimizer steps 4 and 5: after 2 waited, 1 warmed up
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the model's operators are in it
    assert "Self CPU" in (run / "profile" / "summary.txt").read_text()
    log = (run / "train.log").read_text()
    assert f"profile: steps 4-5 traced into {run / 'profile'}" in log

    # a run that ends before the schedule's active steps: nothing half-written, the run ends normally
    short = tmp_path / "short"
    result = train_in_process(TINY, short_epochs(text, short, "train.max_steps=3", "checkpoint.every_steps=100",
                                                 "train.profile={wait: 2, warmup: 1, active: 2}"))
    assert result.steps == 3 and not list((short / "profile").glob("*.json"))
    assert "profile: the run ended before step 5, the last one to profile; no trace written" in (
        short / "train.log").read_text()


def test_relative_paths_in_a_recipe_mean_files_next_to_it_and_set_ones_the_current_directory(tmp_path):
    """A project folder (recipe, text, callback file) trained from elsewhere; a --set path is the shell's."""
    import yaml

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "data" / "text.txt").write_text(small_text_file(tmp_path).read_text())
    (project / "hooks.py").write_text(
        "import json\nfrom s4accel import Callback\n\n\nclass Note(Callback):\n"
        "    def on_train_end(self, run):\n"
        "        (run.run_dir / 'note.json').write_text(json.dumps(run.state.step))\n")
    recipe = yaml.safe_load((REPO / "recipes" / "s4_tiny_debug.yaml").read_text())
    recipe.update(data={**recipe["data"], "source": "files", "files": ["data/*.txt"], "seq_len": 32},
                  train={**recipe["train"], "max_steps": 3}, callbacks=[{"target": "hooks.py:Note"}],
                  sample={"prompts": []})
    (project / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    proc = run_cli("train", project / "recipe.yaml", *sets(f"run.out_dir={run}", "log.progress_bar=false"),
                   cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run / "note.json").read_text()) == 3  # the callback from the recipe's folder ran
    kept = yaml.safe_load((run / "recipe.yaml").read_text())
    assert kept["data"]["files"] == [str(project / "data" / "*.txt")]  # absolute: resumable from anywhere
    assert kept["callbacks"][0]["target"] == f"{project / 'hooks.py'}:Note"

    # --set paths are the current directory's: a text in `elsewhere`, none of that name next to the recipe
    (elsewhere / "other.txt").write_text((project / "data" / "text.txt").read_text())
    proc = run_cli("show", project / "recipe.yaml", *sets("data.files=[other.txt]"), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["data"]["files"] == [str(elsewhere / "other.txt")]
    # a path found nowhere stays as written, for the data code to report
    proc = run_cli("train", project / "recipe.yaml", *sets(f"run.out_dir={tmp_path / 'r2'}", "data.files=[nope.txt]"),
                   cwd=elsewhere)
    assert proc.returncode == 2 and "nope.txt" in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_a_bad_model_override_is_reported_before_the_data_is_read(tmp_path):
    # the data file does not exist: an error about it would mean the data was read first
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run'}", "data.source=files",
                                        f"data.files=[{tmp_path / 'missing.txt'}]", "model.overrides={d_model: -3}"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: model.overrides") and "d_model" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_eval_of_a_model_on_a_recipe_of_another_kind_is_one_line(tmp_path):
    from helpers import RECIPES, short_epochs, train_in_process

    text = small_text_file(tmp_path)
    train_in_process(TINY, short_epochs(text, tmp_path / "lm", "train.max_steps=2", "checkpoint.every_steps=100"))
    for recipe, wanted in [("shakespeare_genre.yaml", "a sequence classifier of text"),
                           ("digits.yaml", "a sequence classifier of number sequences")]:
        proc = run_cli("eval", tmp_path / "lm", RECIPES / recipe)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
        assert "a language model of text (S4ForCausalLM) cannot be scored with this recipe" in proc.stderr
        assert f"which trains {wanted}" in proc.stderr
