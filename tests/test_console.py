"""What a run shows: the console without library noise, progress bars only where they help, everything printed
also in the run's train.log, and a warning for a launch that cannot use its topology."""

import json
import os

from helpers import TINY, run_cli, sets, small_text_file

NOISE = ("Removed shared tensor", "Writing model shards", "Loading weights", "dropping empty documents", "tokenizing",
         "Downloading data", "Generating train split")


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


def test_a_run_and_eval_print_no_library_noise(tmp_path):
    bars_as_users_have_them = {"HF_DATASETS_DISABLE_PROGRESS_BARS": None}  # the test session turns them off
    text = small_text_file(tmp_path)
    data = tmp_path / "docs.jsonl"  # a local file datasets reads with its json builder
    data.write_text("\n".join(json.dumps({"text": text.read_text()[i: i + 500]}) for i in range(0, 3000, 500)))
    common = sets(f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{data}]",
                  "data.seq_len=32", "log.progress_bar=false", "sample.prompts=[]")
    proc = run_cli("train", TINY, *common, *sets("train.max_steps=4", "checkpoint.every_steps=2",
                                                 "train.eval_every=2"), env=bars_as_users_have_them, fresh=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert "done: 4 steps" in said and not [n for n in NOISE if n in said], said
    scored = run_cli("eval", tmp_path / "run", TINY, *common, env=bars_as_users_have_them, fresh=True)
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
    from s4accel.training.observe.console import RunLog

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


def test_tokenising_a_few_large_documents_shows_a_bar_in_bytes(monkeypatch, tmp_path, capfd, hf_cache):
    """Three documents of 4 MB showed nothing (datasets' bar counts documents and shows from 10,000): now a bar in
    bytes with the rate. The bar lives outside the mapped function, so the map is still answered from the cache the
    second time (and shows nothing then), and a small text shows no bar."""
    import importlib
    import re

    import datasets
    from transformers import ByT5Tokenizer

    from s4accel.config import SourceCfg
    from s4accel.data.sources import load_source
    from s4accel.data.text import to_blocks

    bars = importlib.import_module("datasets.utils.tqdm")
    monkeypatch.setattr(bars, "HF_DATASETS_DISABLE_PROGRESS_BARS", None)  # as users have them
    datasets.enable_progress_bars()
    play_file = small_text_file(tmp_path)
    play = play_file.read_text()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(play * (4_000_000 // len(play)))
    docs = load_source(SourceCfg(source="files", files=[str(corpus)]))
    capfd.readouterr()
    blocks = to_blocks(docs, ByT5Tokenizer(extra_ids=0), 512)
    shown = capfd.readouterr().err
    assert re.search(r"tokenizing and packing 512: 100%.*12\.0M/12\.0M \[.*[kMG]B/s\]", shown), shown
    again = to_blocks(docs, ByT5Tokenizer(extra_ids=0), 512)
    assert "tokenizing" not in capfd.readouterr().err  # answered from the cache
    assert again.cache_files == blocks.cache_files and len(again) == len(blocks) > 23_000
    small = load_source(SourceCfg(source="files", files=[str(play_file)]))
    to_blocks(small, ByT5Tokenizer(extra_ids=0), 512)
    assert "tokenizing" not in capfd.readouterr().err
