"""Corpora larger than memory and several sources at once: a streamed corpus is one sequence of blocks the processes
take in turn, shuffled by the seed (files and blocks), resumes exactly where it stopped (1 and 2 processes), keeps
memory flat; a checkpoint of the earlier per-process stream still resumes; a mixture draws its sources by weight,
deterministically, and says how much of each it holds."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import (FREE_PORT, REPO, TESTS_ON_PATH, TINY, accelerate_launch, callback_override, final_weights,
                     read_metrics, sets, train_in_process)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """2,000 numbered documents of varied length as 4 JSON Lines files (4 shards), in order."""
    import datasets

    folder = tmp_path_factory.mktemp("corpus")
    for part in range(4):
        datasets.Dataset.from_dict({"text": [f"document {i} " + "to be or not " * (i % 9)
                                             for i in range(500 * part, 500 * (part + 1))]}).to_json(
            str(folder / f"docs_{part}.jsonl"))
    return folder


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
    from s4accel.errors import ResumeError

    with pytest.raises(ResumeError, match=r"read with data.shuffle_buffer=1024, which cannot change mid-stream"):
        train_in_process(TINY, streamed(corpus, tmp_path / "cut", "data.shuffle_buffer=0"), resume="latest",
                         force=True)  # the blocks its buffer holds are part of the position
    resumed = train_in_process(TINY, streamed(corpus, tmp_path / "cut"), resume="latest")
    assert resumed.steps == 12 and same(tmp_path / "ref", tmp_path / "cut")
    losses = lambda d: [r["train/loss"] for r in read_metrics(d) if "train/loss" in r]  # noqa: E731
    assert losses(tmp_path / "cut") == losses(tmp_path / "ref")


def test_processes_take_turns_in_one_sequence_of_blocks_and_validation_is_never_trained_on(corpus, hf_cache):
    """Block i goes to process i mod P: two processes' blocks, taken in turn, are the one process's blocks."""
    from s4accel.config import load_recipe
    from s4accel.data import build_data

    cfg = load_recipe(TINY, streamed(corpus, "unused")).data
    ranks = [iter(build_data(cfg, rank=rank, world_size=2).train) for rank in range(2)]
    data = build_data(cfg)
    alone = iter(data.train)
    for _ in range(60):
        for rank in ranks:
            assert torch.equal(next(rank)["input_ids"], next(alone)["input_ids"])
    blocks = [data.tokenizer.decode(next(alone)["input_ids"].tolist()) for _ in range(600)]  # shuffled: one by one
    seen = {int(n) for text in blocks for n in re.findall(r"document (\d+) ", text)}
    val_text = data.tokenizer.decode(np.asarray(data.val[:]["input_ids"]).reshape(-1).tolist())
    val_docs = {int(n) for n in re.findall(r"document (\d+) ", val_text)}
    assert val_docs and not val_docs & seen and min(seen) > max(val_docs)


def first_blocks(folder, *extra, seed=0, n=20):
    """The files (by number) each of a stream's first `n` blocks holds text of."""
    from s4accel.config import load_recipe
    from s4accel.data import build_data

    cfg = load_recipe(TINY, ["data.source=files", f"data.files=[{folder}]", "data.streaming=true", "data.seq_len=32",
                             f"data.val_files=[{folder.parent / 'val.txt'}]", *extra]).data
    data = build_data(cfg, seed=seed)
    stream = iter(data.train)
    return [tuple(sorted({int(f) for f in re.findall(r"file(\d+)", data.tokenizer.decode(next(stream)[
        "input_ids"].tolist()))})) for _ in range(n)]


def test_a_sorted_stream_is_shuffled_by_the_seed_and_read_in_file_order_without_a_buffer(tmp_path, hf_cache):
    """40 files sorted by name, 12 blocks each: the first blocks come from files all over the corpus (each pass reads
    the files in an order drawn from the seed, and the buffer mixes their blocks), the same under the same seed."""
    folder = tmp_path / "sorted"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i:03d}.txt").write_text(f"file{i:03d} " * 48)
    (tmp_path / "val.txt").write_text("validation " * 40)
    shuffled = first_blocks(folder)
    files = {f for block in shuffled for f in block}
    assert len(files) >= 10 and max(files) >= 30, shuffled  # mixed from many files, far apart
    assert first_blocks(folder) == shuffled and first_blocks(folder, seed=1) != shuffled
    few = first_blocks(folder, "data.shuffle_buffer=2")  # a small buffer: the files' order is shuffled still
    assert {f for block in few for f in block} - {0, 1, 2}, few
    in_order = first_blocks(folder, "data.shuffle_buffer=0")
    assert {f for block in in_order for f in block} == {0, 1}, in_order


def test_a_stream_of_one_file_says_in_one_line_that_only_the_buffer_shuffles_it(corpus, tmp_path, hf_cache):
    """One sorted file streams nearly in order (4.51 bits per byte at step 100 against 3.50 map-style, reported): the
    run says so at its start, and what to do; a corpus of several files does not get the line."""
    from helpers import run_cli

    one = corpus / "docs_0.jsonl"
    for files, expected in (([str(one)], 1), ([str(corpus)], 0)):
        proc = run_cli("train", TINY, *sets(*streamed(corpus, tmp_path / f"r{expected}", f"data.files=[{files[0]}]",
                                                      "train.max_steps=1", "checkpoint.every_steps=0")))
        assert proc.returncode == 0, proc.stderr[-2000:]
        notes = [line for line in proc.stdout.splitlines() if "one shard" in line]
        assert notes == ([f"note: data.files streams as one shard ({one.name}): data.shuffle_buffer=1024 mixes its "
                          f"blocks only with the next 1,024 or so; split it into several files to have its parts "
                          f"read in a random order"] if expected else []), proc.stdout


@pytest.mark.parametrize("shuffle", ["1024", "0"])
def test_a_stream_with_its_own_validation_file_resumes_past_its_next_pass(tmp_path, hf_cache, shuffle):
    """One file streamed, validation from a file of its own: resumed from a checkpoint, the run stopped at the next
    pass with "the training stream holds less than one block", on every retry (the restored position stayed on the
    file's stream and every later pass started there). Resumed now to the end, equal to the run that never stopped."""
    import shutil

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"line {i} " + "to be or not to be, that is the question " * 9})
                            + "\n" for i in range(40)))
    (tmp_path / "a.txt").write_text("validation text " * 40)
    run = [f"data.files=[{good}]", f"data.val_files=[{tmp_path / 'a.txt'}]", f"data.shuffle_buffer={shuffle}",
           "train.max_steps=80", "checkpoint.every_steps=20", "checkpoint.keep_last=5"]
    train_in_process(TINY, streamed(good, tmp_path / "ref", *run))
    shutil.copytree(tmp_path / "ref", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "final")
    resumed = train_in_process(TINY, streamed(good, tmp_path / "cut", *run),
                               resume=str(tmp_path / "cut" / "checkpoints" / "step_00000020"))
    assert resumed.steps == 80 and same(tmp_path / "ref", tmp_path / "cut")
    # stopped by SIGTERM mid-pass (a checkpoint of its own), then resumed with the printed command's --resume
    stopped = train_in_process(TINY, streamed(good, tmp_path / "term", *run, callback_override(
        "testing_callbacks:SignalAt", step=33)))
    assert stopped.preempted
    resumed = train_in_process(TINY, streamed(good, tmp_path / "term", *run), resume="latest")
    assert resumed.steps == 80 and same(tmp_path / "ref", tmp_path / "term")


LAUNCH = [*FREE_PORT, "--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml", "-m", "s4accel", "train", TINY]


def launch(overrides, *flags):
    return accelerate_launch(*LAUNCH, *sets(*overrides), *flags, env=TESTS_ON_PATH, timeout=900)


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
            "data.shuffle_buffer=16",  # the default 1,024 blocks would hold the whole first file before step 1
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


def as_saved_by_the_earlier_version(run_dir):
    """A run directory's checkpoint as the earlier per-process stream wrote it (measured against that version: at 1
    process its state is this one's without the shard and the buffers, inside a list of one per process) and its
    recipes without data.shuffle_buffer, which did not exist; the manifest rewritten to match."""
    import hashlib

    import yaml

    ckpt = sorted((run_dir / "checkpoints").iterdir())[-1]
    changed = []
    for f in ckpt.glob("custom_checkpoint_*.pkl"):
        state = torch.load(f, weights_only=True)
        if isinstance(state, dict) and "stream" in state:
            own = {k: v for k, v in state["stream"].items() if k not in ("buffers", "shuffle_buffer")}
            own["sources"] = [{k: v for k, v in s.items() if k != "shard"} for s in own["sources"]]
            torch.save({"processes": [own]}, f)
            changed.append(f)
    for f in (run_dir / "recipe.yaml", ckpt / "recipe.yaml"):
        recipe = yaml.safe_load(f.read_text())
        del recipe["data"]["shuffle_buffer"]
        f.write_text(yaml.safe_dump(recipe, sort_keys=False))
        changed.append(f)
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    for f in (f for f in changed if f.parent == ckpt):
        manifest["files"][f.name] = {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))
    return ckpt


def test_a_checkpoint_of_the_earlier_per_process_stream_resumes_exactly_unshuffled_or_is_refused_in_one_line(
        corpus, tmp_path, hf_cache):
    """Checkpoints written before the stream was one sequence hold one position per process and a recipe without
    data.shuffle_buffer: the run continues bit for bit with data.shuffle_buffer=0 (which such a recipe reads as), and
    with shuffling on it is refused in one line (on another number of processes: test_world_size.py)."""
    from s4accel.errors import ResumeError

    unshuffled, short = "data.shuffle_buffer=0", "train.max_steps=8"
    train_in_process(TINY, streamed(corpus, tmp_path / "ref", unshuffled, short))
    train_in_process(TINY, streamed(corpus, tmp_path / "cut", unshuffled, short,
                                    callback_override("testing_callbacks:SignalAt", step=3)))
    as_saved_by_the_earlier_version(tmp_path / "cut")
    with pytest.raises(ResumeError, match=r"^the checkpoint's data stream was saved by an earlier s4accel, which read "
                                          r"streams unshuffled: resume it with --set data.shuffle_buffer=0$"):
        train_in_process(TINY, streamed(corpus, tmp_path / "cut", short), resume="latest", force=True)
    resumed = train_in_process(TINY, streamed(corpus, tmp_path / "cut", unshuffled, short), resume="latest")
    assert resumed.steps == 8 and same(tmp_path / "ref", tmp_path / "cut")


def test_two_processes_on_a_stream_shorter_than_one_block_both_stop_at_the_same_line(tmp_path):
    """Rank 0 said the one line, then rank 1's gloo "Connection closed by peer" traceback: it waited for rank 0,
    which had gone. Now every process meets the same error, said once."""
    train = tmp_path / "train.txt"
    train.write_text("short")
    val = tmp_path / "val.txt"
    val.write_text("A validation document long enough for a block or two. " * 8)
    proc = launch([f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{train}]",
                   "data.streaming=true", f"data.val_files=[{val}]", "data.seq_len=32", "train.max_steps=3",
                   "log.progress_bar=false", "sample.prompts=[]"])
    assert proc.returncode != 0
    ours = proc.stderr.split("ChildFailedError", 1)[0]  # what the processes said, before the launcher's report
    assert ours.count("holds less than one block of data.seq_len=32 tokens") == 1, proc.stderr[-3000:]
    assert "gloo" not in ours and "Connection closed" not in ours and "[rank" not in ours, ours[-3000:]
