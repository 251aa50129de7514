"""`train.context_parallel`: the processes of a group share each sequence, one contiguous chunk each, and train what
one process reading whole sequences trains; beside data parallelism (2 x 2 on 4 CPU processes), with accumulation,
clipping, EMA, checkpoints, an exact resume and an export that generates; and what it refuses, in one line."""

import shutil

import pytest
import torch

from helpers import FREE_PORT, REPO, TINY, accelerate_launch, final_weights, run_cli
from s4accel.config import load_recipe
from s4accel.errors import RecipeError

LAUNCH = [*FREE_PORT, "--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml"]
QUIET = "log.progress_bar=false"


def launch(procs, recipe, run_dir, *sets, timeout=600):
    """`s4accel train` on `procs` processes (1: the CLI alone), each of `sets` a `--set`."""
    sets = [x for s in (f"run.out_dir={run_dir}", QUIET, *sets) for x in ("--set", s)]
    if procs == 1:
        return run_cli("train", recipe, *sets)
    return accelerate_launch(*LAUNCH, "--num_processes", procs, "-m", "s4accel", "train", recipe, *sets,
                             timeout=timeout)


def trained(procs, recipe, run_dir, *sets) -> str:
    """`launch`, which must succeed; its standard output."""
    proc = launch(procs, recipe, run_dir, *sets)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
def test_two_processes_sharing_each_sequence_train_what_one_process_trains(tmp_path, hf_cache):
    """20 steps of the language model: the same weights (1e-5), the same losses logged."""
    trained(1, TINY, tmp_path / "one")
    out = trained(2, TINY, tmp_path / "split", "train.context_parallel=2")
    assert "context parallel: each sequence of 64 steps split over 2 processes (chunks of 32)" in out
    assert max_diff(final_weights(tmp_path / "one"), final_weights(tmp_path / "split")) < 1e-5


@pytest.mark.slow
def test_a_classifier_split_over_two_processes_trains_what_one_process_trains(tmp_path, hf_cache):
    """The digits' bidirectional classifier (pooled over the whole sequence, its loss, label-smoothed, the same on
    both processes)."""
    digits = REPO / "recipes" / "digits.yaml"
    sets = ["model.overrides.dropout=0.0", "train.max_steps=8", "train.eval_every=0", "checkpoint.every_steps=0",
            "train.label_smoothing=0.2"]
    trained(1, digits, tmp_path / "one", *sets)
    trained(2, digits, tmp_path / "split", "train.context_parallel=2", *sets)
    assert max_diff(final_weights(tmp_path / "one"), final_weights(tmp_path / "split")) < 1e-5


@pytest.mark.slow
def test_two_by_two_layout_trains_as_data_parallel_resumes_exactly_and_exports(tmp_path, hf_cache):
    """4 processes: 2 data-parallel groups of 2 sharing each sequence, with accumulation, clipping, EMA and label
    smoothing (the smoothed loss of each chunk's shifted targets), train what 2 data-parallel processes reading whole
    sequences train; stopped and resumed, the run ends where an uninterrupted one does; another layout is refused on
    resume; the export generates."""
    sets = ["train.max_steps=8", "train.grad_accum=2", "train.clip_grad_norm=0.5", "train.ema.decay=0.9",
            "checkpoint.every_steps=4", "checkpoint.keep_last=2", "train.eval_every=4", "train.label_smoothing=0.1"]
    trained(2, TINY, tmp_path / "ddp", *sets)
    assert "2 data-parallel group(s)" in trained(4, TINY, tmp_path / "whole", "train.context_parallel=2", *sets)
    for name in ("final", "final_ema"):
        assert max_diff(final_weights(tmp_path / "ddp", name), final_weights(tmp_path / "whole", name)) < 1e-5

    # the run stopped after step 4: its last checkpoint and its export gone, it resumes from step 4
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_00000008")
    shutil.rmtree(tmp_path / "cut" / "final")
    other = launch(4, TINY, tmp_path / "cut", "train.context_parallel=1", *sets, "train.resume=auto")
    assert other.returncode != 0
    assert "resumes on the layout it was saved by only" in other.stdout + other.stderr
    resumed = trained(4, TINY, tmp_path / "cut", "train.context_parallel=2", *sets, "train.resume=auto")
    assert "step_00000004 at step 4" in resumed
    for name in ("final", "final_ema"):
        assert max_diff(final_weights(tmp_path / "whole", name), final_weights(tmp_path / "cut", name)) < 1e-6

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "final")
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False).shape == (1, 7)
    assert (tmp_path / "whole" / "samples.txt").read_text().count("--- sample") == 1


@pytest.mark.parametrize("sets, words", [
    (["model.name=moe-tiny"], "Accelerate's context parallelism"),
    (["train.state.mode=tbptt"], "stateful training"),
    (["data.streaming=true"], "streamed source"),
    (["train.compile=true"], "not compiled"),
    (["model.overrides.capacity_factor=1.0", "model.overrides.ffn=moe"], "capacity_factor and router_jitter"),
    (["data.seq_len=63"], "must divide data.seq_len=63"),
])
def test_what_a_split_sequence_cannot_do_is_one_line_naming_the_key(sets, words):
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, ["train.context_parallel=2", *sets])
    message = str(info.value)
    assert "train.context_parallel: 2" in message and words in message and "\n" not in message


def test_more_processes_per_sequence_than_the_run_has_is_refused_before_any_compute(tmp_path):
    proc = launch(1, TINY, tmp_path / "run", "train.context_parallel=2")
    assert proc.returncode == 2
    assert "train.context_parallel: 2 must divide the run's 1 process(es)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_dropout_does_not_depend_on_how_many_processes_share_a_sequence(tmp_path, hf_cache):
    """With dropout, 2 and 4 processes per sequence draw the same masks: the same weights after 6 steps."""
    sets = ["model.overrides.dropout=0.2", "train.max_steps=6", "train.eval_every=0", "checkpoint.every_steps=0",
            "sample.prompts=[]"]
    trained(2, TINY, tmp_path / "two", "train.context_parallel=2", *sets)
    trained(4, TINY, tmp_path / "four", "train.context_parallel=4", *sets)
    assert max_diff(final_weights(tmp_path / "two"), final_weights(tmp_path / "four")) < 1e-5


@pytest.mark.slow
def test_the_long_sequence_recipe_trains_on_two_processes(tmp_path, hf_cache):
    """recipes/shakespeare_long.yaml: sequences of 65,536 bytes split over 2 processes (a few steps here)."""
    out = trained(2, REPO / "recipes" / "shakespeare_long.yaml", tmp_path / "run", "train.max_steps=2",
                  "checkpoint.every_steps=0", "sample.max_new_tokens=8")
    assert "each sequence of 65,536 steps split over 2 processes (chunks of 32,768)" in out
    assert "done: 2 steps" in out and (tmp_path / "run" / "final" / "model.safetensors").exists()
