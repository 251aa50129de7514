"""Resuming on another number of processes than the checkpoint was saved by (a smaller allocation after preemption,
torchrun's elastic restarts, more GPUs once they are free).

What a run's position means, whatever the number of processes: with the seedable sampler, an epoch is one
permutation of the training examples (seeded by the run's seed and the epoch, not by the process count), cut into
micro-batches of `data.batch_size` that the processes take in turn. So one optimizer step trains on the next
`global batch = processes x data.batch_size x train.grad_accum` examples of the permutation, however they are dealt
out, and the position in an epoch is a count of examples (`micro-batches per process x data.batch_size x
processes`). A resume on P' processes keeps the global batch (a recipe's `data.batch_size` or `train.grad_accum`
changed so that the product is the same, or `--force`, which recomputes `train.grad_accum`) and skips the same
count of examples: every later step trains on the same examples as the run that never stopped, up to the order of
floating-point sums.

What a checkpoint holds carries over: the model and the optimizer's state (whole under DDP; under FSDP
torch.distributed.checkpoint reshards them), the schedule and the loop's counters, the EMA (saved whole). The
random streams of each process cannot (there is one per process): they are derived again from the seed, the step
and the process, so dropout and the router's jitter draw other numbers than the uninterrupted run would have.
A streamed source (data.streaming) moves the same way: its blocks are one sequence that the processes take in turn,
so its position is one state, the same on every process and for any number of them (data/streaming.py).
Not carried over, and refused: stateful training (each process carries the recurrent state of its own rows), a stream
saved by an earlier version (one share of it per process) and DeepSpeed's ZeRO checkpoints (one optimizer partition
per process, which DeepSpeed loads only on as many processes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import set_seed

from ...config import Recipe
from ...data.streaming import per_process_refusal, saved_per_process
from ...errors import ResumeError
from .checkpoint import TrainState, checkpoint_recipe


@dataclass(frozen=True)
class World:
    processes: int
    batch_size: int
    """Examples per micro-batch and process (`data.batch_size`)."""
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.processes * self.batch_size * self.grad_accum

    def describe(self) -> str:
        return (f"{self.processes} process(es) x data.batch_size {self.batch_size} x train.grad_accum "
                f"{self.grad_accum} = {self.global_batch} examples per step")


def saved_world(ckpt: Path) -> World:
    """The world a checkpoint was saved by: one random-state file per process, and its recipe."""
    recipe = checkpoint_recipe(ckpt)
    processes = len(list(ckpt.glob("random_states_*.pkl")))
    return World(processes, int(recipe["data"]["batch_size"]), int(recipe["train"]["grad_accum"]))


def plan_world_change(ckpt: Path, recipe: Recipe, processes: int, force: bool) -> tuple[Recipe, World | None]:
    """Whether the run may continue on `processes` processes, and how: the recipe to run (with `--force`,
    `train.grad_accum` recomputed to keep the checkpoint's global batch) and the saved world when it differs from
    this one (None: the same number of processes, nothing to convert). Refusals are one `ResumeError`."""
    old = saved_world(ckpt)
    split = int(checkpoint_recipe(ckpt)["train"].get("context_parallel", 1))
    if split != recipe.train.context_parallel or (split > 1 and old.processes != processes):
        # its data position and random streams are per data-parallel group and per process of a context group
        raise ResumeError(f"{ckpt} was saved by {old.processes} process(es) with train.context_parallel: {split}; "
                          f"this run has {processes} with {recipe.train.context_parallel}: a context-parallel run "
                          f"resumes on the layout it was saved by only")
    if old.processes == processes:
        return recipe, None
    what = f"{ckpt} was saved by {old.processes} process(es), this run has {processes}"
    if recipe.train.state.mode != "none":
        raise ResumeError(f"{what}: stateful training (train.state.mode: {recipe.train.state.mode}) carries each "
                          f"process's own rows from chunk to chunk and cannot change its number of processes; "
                          f"resume on {old.processes}")
    if recipe.data.streaming and (shares := saved_stream_shares(ckpt)) is not None:
        raise ResumeError(f"{what}: {per_process_refusal(shares)}")
    if next(ckpt.rglob("*optim_states.pt"), None) is not None:
        raise ResumeError(f"{what}: DeepSpeed's ZeRO checkpoint holds one optimizer partition per process, which it "
                          f"loads only on as many processes; resume on {old.processes}")
    new = World(processes, recipe.data.batch_size, recipe.train.grad_accum)
    if new.global_batch == old.global_batch:
        return recipe, old
    per_step = processes * recipe.data.batch_size
    if force and old.global_batch % per_step == 0:  # the recipe said how to adapt: by accumulating more or less
        ga = old.global_batch // per_step
        adapted = recipe.model_copy(update={"train": recipe.train.model_copy(update={"grad_accum": ga})})
        return adapted, old
    hint = (f"set data.batch_size={old.global_batch // processes} (or a smaller one with train.grad_accum making up "
            f"the product)" if old.global_batch % processes == 0 else
            f"no data.batch_size fits {old.global_batch} examples on {processes} processes")
    how = (f"--force cannot recompute train.grad_accum: {old.global_batch} is not a multiple of {per_step}" if force
           else "or --force, which recomputes train.grad_accum when it can")
    raise ResumeError(f"{what}: the checkpoint trained on {old.describe()}, this run would train on "
                      f"{new.global_batch} (a different global batch is another training run): {hint}; {how}")


def saved_stream_shares(ckpt: Path) -> int | None:
    """The number of per-process shares of a stream an earlier version saved in `ckpt` (None: none such). The saved
    objects are read as plain data and tensors only (`weights_only`), as every checkpoint file is before loading."""
    for path in sorted(ckpt.glob("custom_checkpoint_*.pkl")):
        try:
            shares = saved_per_process(torch.load(path, map_location="cpu", weights_only=True))
        except Exception:  # not this one's to judge: the resume's own checks name a damaged file
            continue
        if shares is not None:
            return shares
    return None


def move_to_world(state: TrainState, old: World, new: World, seed: int, rank: int) -> None:
    """After loading a checkpoint saved by `old`: the position in the epoch as this world's micro-batches per process
    (the same count of examples), and this process's random streams derived from the seed, the step and its rank."""
    examples = state.batch_in_epoch * old.batch_size * old.processes
    per_micro_step = new.batch_size * new.processes
    if examples % per_micro_step:
        raise ResumeError(f"the checkpoint stopped {examples} examples into epoch {state.epoch}, which is not a whole "
                          f"number of this run's micro-batches ({new.processes} process(es) x data.batch_size "
                          f"{new.batch_size}); resume on {old.processes} process(es), or with a data.batch_size "
                          f"that divides it")
    state.batch_in_epoch = examples // per_micro_step
    set_seed(derived_seed(seed, state.step, rank))


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A seed of its own for each (run seed, step, process), within the 32 bits NumPy takes."""
    return (seed * 1_000_003 + step * 7_919 + rank) % 2**32


def launch_asked_for() -> int | None:
    """The processes `accelerate launch --num_processes N` asked for, read from the launcher's command line (the
    parent process; /proc), or None. Without a config file Accelerate's plain launcher starts one process where
    there is no GPU whatever N says, and the run would otherwise only show it in its header."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(arg == "launch" or arg.endswith("accelerate.commands.launch") for arg in argv):
        return None  # not `accelerate launch` (or `python -m accelerate.commands.launch`)
    for i, arg in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            if arg == flag and i + 1 < len(argv) and argv[i + 1].isdigit():
                return int(argv[i + 1])
            if arg.startswith(flag + "=") and arg.split("=", 1)[1].isdigit():
                return int(arg.split("=", 1)[1])
    return None
