"""Corpora larger than memory and several sources at once: a streamed corpus is shared between processes without
overlap, resumes exactly where it stopped (1 and 2 processes), keeps memory flat; a mixture draws its sources by
weight, deterministically, and says how much of each it holds."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import REPO, TINY, callback_override, final_weights, read_metrics, train_in_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """2,000 numbered documents of varied length as JSON Lines."""
    import datasets

    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    datasets.Dataset.from_dict({"text": [f"document {i} " + "to be or not " * (i % 9) for i in range(2000)]}).to_json(
        str(path))
    return path


def streamed(corpus, out, *extra):
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{corpus}]", "data.streaming=true",
            "data.seq_len=32", "data.batch_size=4", "data.val_blocks=8", "model.overrides={dropout: 0.1}",
            "train.grad_accum=2", "train.max_steps=12", "train.eval_every=6", "checkpoint.every_steps=4",
            "scheduler.warmup_steps=0", "log.log_every=1", "log.log_with=[jsonl]", "log.progress_bar=false",
            "sample.prompts=[]", *extra]


def same(a, b):
    wa, wb = final_weights(a), final_weights(b)
    return all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_streamed_run_resumes_exactly_where_it_stopped(corpus, tmp_path, hf_cache):
    train_in_process(TINY, streamed(corpus, tmp_path / "ref"))
    cut = train_in_process(TINY, streamed(corpus, tmp_path / "cut",
                                          callback_override("testing_callbacks:SignalAt", step=5)))
    assert cut.preempted and cut.steps < 12
    resumed = train_in_process(TINY, streamed(corpus, tmp_path / "cut"), resume="latest")
    assert resumed.steps == 12 and same(tmp_path / "ref", tmp_path / "cut")
    losses = lambda d: [r["train/loss"] for r in read_metrics(d) if "train/loss" in r]  # noqa: E731
    assert losses(tmp_path / "cut") == losses(tmp_path / "ref")


def test_processes_read_disjoint_shares_and_validation_is_never_trained_on(corpus, hf_cache):
    from s4accel.config import load_recipe
    from s4accel.data import build_data

    cfg = load_recipe(TINY, streamed(corpus, "unused")).data
    seen = []
    for rank in range(2):
        data = build_data(cfg, rank=rank, world_size=2)
        stream = iter(data.train)
        text = "".join(data.tokenizer.decode(next(stream)["input_ids"].tolist()) for _ in range(60))
        seen.append({int(n) for n in re.findall(r"document (\d+) ", text)})
    val_text = data.tokenizer.decode(np.asarray(data.val[:]["input_ids"]).reshape(-1).tolist())
    val_docs = {int(n) for n in re.findall(r"document (\d+) ", val_text)}
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    assert not val_docs & (seen[0] | seen[1]) and min(seen[0] | seen[1]) > max(val_docs)


LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          str(REPO / "accelerate_configs" / "cpu_2proc.yaml"), "-m", "s4accel", "train", str(TINY)]


def launch(overrides, *flags):
    args = list(LAUNCH)
    for item in overrides:
        args += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    return subprocess.run([*args, *flags], capture_output=True, text=True, timeout=900, cwd=REPO, env=env)


def test_two_processes_stream_resume_bit_exactly(corpus, tmp_path, hf_cache):
    proc = launch(streamed(corpus, tmp_path / "ref"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = launch(streamed(corpus, tmp_path / "cut", callback_override("testing_callbacks:SignalAt", step=5, rank=1)))
    assert proc.returncode == 0 and "stopped at step" in proc.stdout, proc.stderr[-3000:]
    proc = launch(streamed(corpus, tmp_path / "cut"), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same(tmp_path / "ref", tmp_path / "cut")


MEMORY = """
import json, resource, sys
from s4accel.config import load_recipe
from s4accel.data import build_data
cfg = load_recipe(sys.argv[1], ["data.source=files", f"data.files=[{sys.argv[2]}]", "data.streaming=true",
                                "data.seq_len=256", "sample.prompts=[]"]).data
stream = iter(build_data(cfg).train)
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, MiB
marks, n = {}, 0
for block in stream:
    n += 1
    if n in (2_000, 60_000, 120_000):
        marks[n] = rss()
    if n == 120_000:  # 31 M tokens: about 30 MB of text read, tokenised and packed
        break
print(json.dumps(marks))
"""


def test_a_long_stream_keeps_memory_flat(tmp_path):
    import datasets

    big = tmp_path / "big.parquet"
    line = "Now is the winter of our discontent made glorious summer by this sun of York; " * 4
    datasets.Dataset.from_dict({"text": [f"{i} {line}" for i in range(100_000)]}).to_parquet(str(big))  # ~33 MB
    proc = subprocess.run([sys.executable, "-c", MEMORY, str(TINY), str(big)], capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    marks = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert marks[120_000] - marks[2_000] < 40, marks  # the whole corpus passed through; memory did not follow


# ---- mixtures -------------------------------------------------------------------------------------------------------


def mixture(tmp_path, weights=(3, 1), streaming=False):
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "b").mkdir(exist_ok=True)
    for i in range(40):
        (tmp_path / "a" / f"{i}.txt").write_text(f"alpha {i} " * 30)
        (tmp_path / "b" / f"{i}.txt").write_text(f"beta {i} " * 30)
    (tmp_path / "val.txt").write_text("alpha beta " * 200)
    return [f"data.mixture=[{{source: files, files: [{tmp_path / 'a'}], weight: {weights[0]}}}, "
            f"{{source: files, files: [{tmp_path / 'b'}], weight: {weights[1]}}}]",
            f"data.val_files=[{tmp_path / 'val.txt'}]", "data.seq_len=32", "data.source=files",
            f"data.streaming={str(streaming).lower()}", "sample.prompts=[]"]


def source_shares(data, n):
    stream = iter(data.train) if hasattr(data.train, "__iter__") and not hasattr(data.train, "__len__") else None
    rows = [next(stream)["input_ids"] for _ in range(n)] if stream else [data.train[i]["input_ids"] for i in range(n)]
    text = [data.tokenizer.decode(np.asarray(r).tolist()) for r in rows]
    return sum("alpha" in t for t in text) / n, text


@pytest.mark.parametrize("streaming", [False, True])
def test_a_mixture_draws_by_weight_the_same_way_under_the_same_seed(tmp_path, hf_cache, streaming):
    from s4accel.config import load_recipe
    from s4accel.data import build_data

    cfg = load_recipe(TINY, mixture(tmp_path, streaming=streaming)).data
    share, text = source_shares(build_data(cfg, seed=0), 200)
    assert 0.65 < share < 0.85  # weight 3 : 1
    assert source_shares(build_data(cfg, seed=0), 200)[1] == text
    assert source_shares(build_data(cfg, seed=1), 200)[1] != text
    if not streaming:
        counts = build_data(cfg, seed=0).source_tokens
        assert list(counts) == [str(tmp_path / "a"), str(tmp_path / "b")]
        assert 2.5 < counts[str(tmp_path / "a")] / counts[str(tmp_path / "b")] < 3.5


@pytest.mark.parametrize("streaming, packing", [(False, "concat"), (True, "concat"), (False, "isolated"),
                                                (True, "isolated")])
def test_a_mixture_run_resumes_exactly(tmp_path, hf_cache, streaming, packing):
    common = [*mixture(tmp_path, streaming=streaming), "data.batch_size=4", "model.overrides={dropout: 0.1}",
              f"data.packing={packing}",
              "train.max_steps=10", "train.eval_every=5", "checkpoint.every_steps=3", "scheduler.warmup_steps=0",
              "log.progress_bar=false", "log.log_with=[jsonl]"]
    train_in_process(TINY, [f"run.out_dir={tmp_path / 'ref'}", *common])
    train_in_process(TINY, [f"run.out_dir={tmp_path / 'cut'}", *common,
                            callback_override("testing_callbacks:SignalAt", step=4)])
    train_in_process(TINY, [f"run.out_dir={tmp_path / 'cut'}", *common], resume="latest")
    assert same(tmp_path / "ref", tmp_path / "cut")


@pytest.mark.parametrize("case", ["one document, read by the validation head", "training file shorter than a block"])
def test_a_stream_with_less_than_one_training_block_is_one_line_before_training_not_a_hang(tmp_path, case):
    from helpers import run_cli

    train = tmp_path / "train.txt"
    if case.startswith("one document"):
        train.write_text("ROMEO. But soft, what light through yonder window breaks? " * 4)
        extra = ["--set", "data.val_blocks=1"]
    else:
        train.write_text("short")
        val = tmp_path / "val.txt"
        val.write_text("A validation document long enough for a block or two. " * 8)
        extra = ["--set", f"data.val_files=[{val}]"]
    args = [f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{train}]", "data.streaming=true",
            "data.seq_len=32", "train.max_steps=3", "log.progress_bar=false", "sample.prompts=[]"]
    proc = run_cli("train", TINY, *[a for o in args for a in ("--set", o)], *extra, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "holds less than one block of data.seq_len=32 tokens" in proc.stderr and "Traceback" not in proc.stderr
    assert "step 1" not in proc.stdout


def test_a_bad_line_the_stream_reaches_mid_training_stops_in_one_line_and_the_run_resumes_once_mended(tmp_path):
    """The second file is opened only after the first is used up (datasets reads ahead 1,000 documents), dozens of
    steps into the run: its bad line is one line naming it, exit 2, the last checkpoint kept to resume from."""
    from helpers import run_cli

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps({"text": f"doc {i}."}) + "\n" for i in range(1200)))
    good = "".join(json.dumps({"text": f"more {i}."}) + "\n" for i in range(50))
    second.write_text(good + '{"text": broken\n')
    args = [f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{first},{second}]",
            "data.streaming=true", "data.seq_len=32", "data.batch_size=4", "data.val_blocks=2", "train.max_steps=200",
            "train.eval_every=0", "checkpoint.every_steps=10", "checkpoint.keep_last=1", "scheduler.warmup_steps=0",
            "log.progress_bar=false", "log.log_with=[jsonl]", "sample.prompts=[]"]
    sets = [a for o in args for a in ("--set", o)]
    proc = run_cli("train", TINY, *sets, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(line) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"error: data.files: .*b.jsonl: a streamed file could not be read \(JSON parse error.*\), after "
                     r"\d+ documents of epoch 0: mend or remove it, then resume", line[0]), line[0]
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved and int(saved[-1].split("_")[1]) >= 20  # dozens of steps were trained and kept
    second.write_text(good)
    resumed = run_cli("train", TINY, *sets, "--set", "train.max_steps=" + str(int(saved[-1].split("_")[1]) + 5),
                      "--resume", "--force", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
