"""Epochs: the hooks at each pass over the data, `train.max_epochs` in whole passes (per process, in whole
windows), and refused where a run has no epochs."""

import json

from helpers import TESTS_ON_PATH, TINY, read_metrics, run_cli, sets, small_text_file


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


def test_a_warmup_longer_than_the_run_is_cut_to_it_with_one_line(tmp_path):
    """`--set train.max_steps=1` on a recipe that warms up for 2 steps runs (it was a recipe error until the warmup
    was lowered too); so does a warmup longer than what `train.max_epochs` comes to. The schedule warms up over the
    whole run, and the run says so once."""
    text = small_text_file(tmp_path)
    common = ["data.source=files", f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4", "log.log_every=1",
              "log.log_with=[jsonl]", "log.progress_bar=false", "sample.prompts=[]", "train.eval_every=0"]
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'one'}", *common, "train.max_steps=1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    assert said == ["warning: scheduler.warmup_steps=2 is longer than the run (train.max_steps=1): warming up over "
                    "all 1 step(s) instead (scheduler.warmup_ratio scales the warmup with the run)"], proc.stdout
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'epoch'}", *common, "train.max_steps=null",
                                        "train.max_epochs=1", "scheduler.warmup_steps=500"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "scheduler.warmup_steps=500 is longer than the run (the 23 steps of train.max_epochs=1)" in proc.stdout
    lrs = [r["train/lr_decay"] for r in read_metrics(tmp_path / "epoch") if "train/lr_decay" in r]
    assert len(lrs) == 23 and lrs == sorted(lrs) and lrs[-1] == 3e-3  # rising over the whole run to the peak



def test_eval_every_epoch_evaluates_after_each_pass_with_max_epochs_or_max_steps(tmp_path):
    """`train.eval_every: epoch`, as Lightning evaluates: after the step that finished each pass over the training data
    (20 micro-batches here) and at the end; a run resumed mid-epoch evaluates where an uninterrupted one does."""
    from helpers import callback_override, short_epochs, train_in_process

    text = small_text_file(tmp_path)

    def eval_steps(name, *extra, resume=None):
        out = tmp_path / name
        train_in_process(TINY, short_epochs(text, out, "train.eval_every=epoch", "checkpoint.every_steps=100", *extra),
                         resume=resume)
        return [r["step"] for r in read_metrics(out) if "eval/loss" in r]

    # windows of 2: a pass is 10 steps; of 3: the passes end inside steps 7 (micro-batches 19-21) and 14
    assert eval_steps("epochs", "train.max_steps=null", "train.max_epochs=2") == [10, 20]
    assert eval_steps("windows", "train.max_steps=null", "train.max_epochs=2", "train.grad_accum=3") == [7, 14]
    assert eval_steps("steps", "train.max_steps=24") == [10, 20, 24]  # and the last step
    cut = eval_steps("cut", "train.max_steps=24", callback_override("testing_callbacks:SignalAt", step=12))
    assert cut == [10] and eval_steps("cut", "train.max_steps=24", resume="latest") == [10, 20, 24]


def test_eval_every_epoch_on_a_stream_is_a_recipe_error(tmp_path):
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run'}", "data.streaming=true",
                                        "train.eval_every=epoch"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "train.eval_every: a streamed source" in proc.stderr and "every N steps" in proc.stderr
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run'}", "train.eval_every=epochs"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "train.eval_every: expected a number of steps (0: only at the end) or 'epoch', got 'epochs'" in proc.stderr
