"""A run resumed on another number of processes (1 -> 2, 2 -> 1, 2 -> 4 CPU processes) keeps its global batch and
trains every later step on exactly the examples of the run that never stopped (audited by a task that records each
micro-batch's rows), ending within floating-point rounding of its weights; so does a streamed run (one source, or a
mixture), whose blocks are one sequence for any number of processes; a different global batch is refused in one
line unless `--force` may recompute `train.grad_accum`; what cannot move (stateful training, an earlier version's
per-process stream, DeepSpeed's partitions) is refused. s4accel/training/runs/world.py says why the position is a count
of examples."""

import collections
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers import REPO, TESTS_ON_PATH, TINY, accelerate_launch, final_weights, run_cli, small_text_file

pytestmark = pytest.mark.slow

STEPS = 12


@pytest.fixture(scope="module")
def texts(tmp_path_factory, hf_cache):
    """A training text of exactly 128 blocks of 32 bytes (4,095 characters and the end-of-document token), so every
    epoch divides into global micro-batches of 8 and 16 examples, a validation text of its own, and a second source
    for a mixture."""
    folder = tmp_path_factory.mktemp("world")
    text = small_text_file(folder, chars=6000).read_text()
    assert len(text.encode()) == len(text)  # one byte, one token
    (folder / "train.txt").write_text(text[:4095])
    (folder / "val.txt").write_text(text[4095:])
    (folder / "other.txt").write_text((REPO / "README.md").read_text()[:4095])
    return folder / "train.txt", folder / "val.txt"


def mixture(texts) -> tuple[str, ...]:
    """The training text and a second source mixed half and half (map-style: `interleave_datasets`)."""
    train, _ = texts
    return (f"data.mixture=[{{source: files, files: [{train}], weight: 1}}, {{source: files, files: "
            f"[{train.parent / 'other.txt'}], weight: 1}}]", "data.files=[]")


def launch(processes: int, texts, out: Path, *extra: str, resume: bool = False, force: bool = False):
    train, val = texts
    sets = [f"run.out_dir={out}", "data.source=files", f"data.files=[{train}]", f"data.val_files=[{val}]",
            "data.seq_len=32", "model.overrides={dropout: 0.0}", f"train.max_steps={STEPS}",
            f"train.eval_every={STEPS}", "checkpoint.every_steps=6", "checkpoint.keep_last=3",
            "log.progress_bar=false", "sample.prompts=[]", "task.target=testing_tasks:RecordBatches", *extra]
    args = ["train", TINY, *(a for s in sets for a in ("--set", s)), *(["--resume"] if resume else []),
            *(["--force"] if force else [])]
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), TESTS_ON_PATH["PYTHONPATH"]])}
    if processes == 1:
        return run_cli(*args, env=env)
    return accelerate_launch("--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml", "--num_processes",
                             processes, "--main_process_port", "0", "-m", "s4accel", *args, env=env)


def batching(processes, batch_size, grad_accum):
    return f"data.batch_size={batch_size}", f"train.grad_accum={grad_accum}"


@pytest.fixture(scope="module")
def references(tmp_path_factory, texts):
    """Uninterrupted runs of 12 steps at 16 examples per step, checkpointed at step 6: 2 processes x 4 x 2, and
    1 process x 8 x 2."""
    root = tmp_path_factory.mktemp("references")
    runs = {}
    for name, processes, sets in ((2, 2, batching(2, 4, 2)), (1, 1, batching(1, 8, 2)),
                                  ("mixture", 2, batching(2, 4, 2) + mixture(texts))):
        proc = launch(processes, texts, root / f"run_{name}", *sets)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = root / f"run_{name}"
    return runs


def from_checkpoint(reference: Path, out: Path, step: int = 6) -> Path:
    """A run directory holding only `reference`'s checkpoint at `step` and its recipe: a run stopped there."""
    shutil.copytree(reference / "checkpoints" / f"step_{step:08d}", out / "checkpoints" / f"step_{step:08d}")
    shutil.copy(reference / "recipe.yaml", out / "recipe.yaml")
    return out


def examples_per_step(run: Path) -> dict[int, collections.Counter]:
    """Every process's micro-batch rows, by the optimizer step they trained."""
    steps = collections.defaultdict(collections.Counter)
    for f in run.glob("rows_*.jsonl"):
        for line in f.read_text().splitlines():
            record = json.loads(line)
            steps[record["step"]].update(record["rows"])
    return steps


@pytest.mark.parametrize("reference, before, after, sets", [
    (2, 2, 1, batching(1, 8, 2)),  # the same micro-batches, gathered on one process
    (1, 1, 2, batching(2, 4, 2)),
    (2, 2, 4, batching(4, 4, 1)),  # one micro-batch per process and step instead of two
    ("mixture", 2, 1, batching(1, 8, 2)),  # two sources interleaved by weight
])
def test_a_run_resumed_on_another_number_of_processes_trains_on_the_same_examples(references, texts, tmp_path,
                                                                                     reference, before, after, sets):
    reference = references[reference]
    out = from_checkpoint(reference, tmp_path / "resumed")
    if "mixture" in reference.name:
        sets = sets + mixture(texts)
    proc = launch(after, texts, out, *sets, resume=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed on {after} process(es) from a checkpoint of {before}" in proc.stdout
    assert "= 16 examples per step (as saved: 16)" in proc.stdout
    assert f"done: {STEPS} steps" in proc.stdout

    ref, got = examples_per_step(reference), examples_per_step(out)
    assert sorted(got) == list(range(6, STEPS))  # it trained steps 6..11, and nothing before
    for step in got:  # no example skipped, none repeated, none moved to another step
        assert got[step] == ref[step], step
    a, b = final_weights(reference), final_weights(out)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, worst  # the order of floating-point sums only (measured: 6e-8 to 1.2e-7)


@pytest.fixture(scope="module")
def stream_texts(tmp_path_factory, texts):
    """The training text as 4 files in two folders (4 shards, or a mixture of two sources), and its validation text."""
    train, val = texts
    text = train.read_text()
    folder = tmp_path_factory.mktemp("stream")
    for i in range(4):
        (folder / "ab"[i // 2]).mkdir(exist_ok=True)
        (folder / "ab"[i // 2] / f"part_{i}.txt").write_text(text[1024 * i: 1024 * (i + 1)])
    return folder, val


def streamed(folder: Path, mixture: bool) -> list[str]:
    """A streamed run with a shuffle buffer smaller than a pass (so that the buffer's contents are part of the
    position), on the 4 files, or on the two folders mixed 3:1."""
    sets = ["data.streaming=true", "data.shuffle_buffer=16"]
    if mixture:
        sets.append(f"data.mixture=[{{source: files, files: [{folder / 'a'}], weight: 3}}, "
                    f"{{source: files, files: [{folder / 'b'}], weight: 1}}]")
    return sets


@pytest.fixture(scope="module")
def stream_references(tmp_path_factory, stream_texts):
    """Uninterrupted streamed runs as `references`: one source on 2 and on 1 process, a mixture on 2."""
    root = tmp_path_factory.mktemp("stream_references")
    folder, val = stream_texts
    runs = {}
    for processes, mixture in ((2, False), (1, False), (2, True)):
        out = root / f"p{processes}{'_mixture' if mixture else ''}"
        proc = launch(processes, (folder, val), out, *streamed(folder, mixture), *batching(processes, 8 // processes,
                                                                                          2))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[processes, mixture] = out
    return runs


def test_a_stream_is_one_sequence_of_blocks_for_any_number_of_processes(stream_references):
    one, two = examples_per_step(stream_references[1, False]), examples_per_step(stream_references[2, False])
    assert sorted(one) == list(range(STEPS)) and one == two


@pytest.mark.parametrize("before, after, mixture", [(2, 1, False), (1, 2, False), (2, 1, True)])
def test_a_streamed_run_resumed_on_another_number_of_processes_trains_on_the_same_blocks(
        stream_references, stream_texts, tmp_path, before, after, mixture):
    folder, val = stream_texts
    reference = stream_references[before, mixture]
    out = from_checkpoint(reference, tmp_path / "resumed")
    proc = launch(after, (folder, val), out, *streamed(folder, mixture), *batching(after, 8 // after, 2),
                  resume=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed on {after} process(es) from a checkpoint of {before}" in proc.stdout
    ref, got = examples_per_step(reference), examples_per_step(out)
    assert sorted(got) == list(range(6, STEPS))
    for step in got:  # no block skipped, none repeated, none moved to another step
        assert got[step] == ref[step], step
    a, b = final_weights(reference), final_weights(out)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, worst  # the order of floating-point sums only (measured: 1.2e-7 to 4.8e-7)


def test_a_different_global_batch_is_refused_unless_force_recomputes_the_accumulation(references, texts, tmp_path):
    out = from_checkpoint(references[2], tmp_path / "half")
    proc = launch(1, texts, out, *batching(1, 4, 2), resume=True)  # 1 x 4 x 2 = 8 examples per step, not 16
    assert proc.returncode == 2
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "saved by 2 process(es), this run has 1" in error[0]
    assert "2 process(es) x data.batch_size 4 x train.grad_accum 2 = 16" in error[0]
    assert "set data.batch_size=16" in error[0] and "--force" in error[0]
    assert not (out / "final").exists()

    proc = launch(1, texts, out, *batching(1, 4, 2), resume=True, force=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 process(es) x data.batch_size 4 x train.grad_accum 4 = 16 examples per step" in proc.stdout
    ref, got = examples_per_step(references[2]), examples_per_step(out)
    assert all(got[step] == ref[step] for step in range(6, STEPS))
    worst = max((final_weights(references[2])[k] - v).abs().max().item() for k, v in final_weights(out).items())
    assert worst < 1e-6, worst


@pytest.mark.parametrize("sets, refused", [
    (["train.state={mode: tbptt}"], "stateful training"),
    (["data.streaming=true"], "the checkpoint's data stream was saved by an earlier s4accel in one share per process"),
    ([], "DeepSpeed's ZeRO checkpoint"),
])
def test_what_cannot_be_dealt_out_again_is_refused_naming_the_reason(tmp_path, text, sets, refused):
    from s4accel import load_recipe
    from s4accel.errors import ResumeError
    from s4accel.training.runs.world import plan_world_change

    ckpt = tmp_path / "checkpoints" / "step_00000006"
    ckpt.mkdir(parents=True)
    recipe = load_recipe(TINY, [f"run.out_dir={tmp_path}", "data.source=files", f"data.files=[{text}]", *sets])
    (ckpt / "recipe.yaml").write_text(recipe.to_yaml())
    for rank in (0, 1):  # saved by two processes
        (ckpt / f"random_states_{rank}.pkl").write_bytes(b"")
        if not sets:  # under DeepSpeed: each process's optimizer partition
            (ckpt / "pytorch_model").mkdir(exist_ok=True)
            (ckpt / "pytorch_model" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    if "data.streaming=true" in sets:  # an earlier version's stream: a position per process
        share = {"sources": [{"epoch": 0, "position": None, "leftover": torch.zeros(0), "ready": None}],
                 "rng": {}, "blocks_seen": torch.zeros(1)}
        torch.save({"processes": [share, share]}, ckpt / "custom_checkpoint_2.pkl")
    assert plan_world_change(ckpt, recipe, 2, force=False) == (recipe, None)  # the same world: nothing to do
    with pytest.raises(ResumeError, match=f"saved by 2 process\\(es\\), this run has 1: {refused}.*resume on 2"):
        plan_world_change(ckpt, recipe, 1, force=True)
    with pytest.raises(ResumeError):
        plan_world_change(ckpt, recipe, 4, force=False)


def test_the_position_in_an_epoch_is_a_count_of_examples():
    from s4accel.errors import ResumeError
    from s4accel.training.runs.checkpoint import TrainState
    from s4accel.training.runs.world import World, derived_seed, move_to_world

    state = TrainState(step=7, epoch=1, batch_in_epoch=6)  # 6 micro-batches x 4 examples x 2 processes = 48
    move_to_world(state, World(2, 4, 2), World(4, 2, 2), seed=0, rank=3)
    assert state.batch_in_epoch == 6  # 48 examples = 6 micro-batches of 4 processes x 2
    move_to_world(state, World(4, 2, 2), World(1, 16, 1), seed=0, rank=0)
    assert state.batch_in_epoch == 3
    with pytest.raises(ResumeError, match="48 examples into epoch 1.*not a whole number"):
        move_to_world(state, World(1, 16, 1), World(1, 32, 1), seed=0, rank=0)
    first = torch.rand(3)
    move_to_world(TrainState(step=7), World(2, 4, 2), World(2, 4, 2), seed=0, rank=1)
    again = torch.rand(3)
    move_to_world(TrainState(step=7), World(2, 4, 2), World(2, 4, 2), seed=0, rank=1)
    assert torch.equal(again, torch.rand(3)) and not torch.equal(first, again)  # derived, reproducibly
    assert len({derived_seed(0, step, rank) for step in range(50) for rank in range(8)}) == 400
