"""Resuming a run: which checkpoint (verified by the main process, the same for every process), whether the recipe
still matches the one it was trained with, loading it with the checks Accelerate does not make, and what `--force`
changes after loading."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from accelerate import PartialState
from accelerate.utils import broadcast_object_list

from ...config import Recipe, flatten
from ...config.durations import spoken
from ...errors import ResumeError
from .checkpoint import TrainState, check_pickles, checkpoint_recipe, locate_checkpoint, move_aside
from ..task import TrainOptimizer

# Recipe keys that do not change what the model computes or sees: they may differ when a run is resumed.
RESUME_NEUTRAL = ("run.name", "run.out_dir", "run.overwrite", "log.", "sample.", "checkpoint.", "callbacks",
                  "train.eval_every", "train.eval_at_start", "train.eval_max_batches", "train.resume", "task.metrics",
                  "data.num_workers", "data.cache_dir", "data.eval_batch_size", "train.activation_checkpointing",
                  "train.peak_tflops", "train.max_time", "data.eval_sets",
                  "hub.", "sweep")


def training_fields(recipe_dict: dict) -> dict:
    """The flattened recipe without the keys a resume may change."""
    return {k: v for k, v in flatten(recipe_dict).items() if not k.startswith(RESUME_NEUTRAL)}


INTRODUCED = {"data.shuffle_buffer": 0, "optim.name": "adamw", "optim.kwargs": "{}", "train.label_smoothing": 0.0,
              "data.max_train_examples": None}
"""Recipe keys added since checkpoints were first written, and the value that means what a recipe without them did:
an older checkpoint's recipe reads as that value (its stream was not shuffled; its optimizer was AdamW; its targets
were not smoothed; it trained on all its examples)."""


def recipe_diff(old: dict, new: dict) -> list[str]:
    """`key: old -> new` for every training-relevant key that differs between two recipe dicts (`old` read with the
    `INTRODUCED` values for keys it predates)."""
    a, b = training_fields(old), training_fields(new)
    a = {**{k: v for k, v in INTRODUCED.items() if not any(o == k or o.startswith(f"{k}.") for o in a)}, **a}
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


def recipe_hash(recipe: Recipe) -> str:
    return hashlib.sha256(json.dumps(training_fields(recipe.to_dict()), sort_keys=True).encode()).hexdigest()[:16]


def choose_checkpoint(run_dir: Path, resume: str | None) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (None: a fresh start) and warnings, decided by the main process and the same on
    every process. Checkpoints newer than the chosen one that failed verification are moved aside."""
    if resume is None:
        return None, []
    state = PartialState()
    choice: list = [None, [], None]  # checkpoint, warnings, error
    if state.is_main_process:
        try:
            ckpt, notes, invalid = locate_checkpoint(run_dir, resume)
            for path in invalid:
                notes.append(f"moved the invalid checkpoint {path.name} aside to {move_aside(path).name}")
            choice = [str(ckpt) if ckpt else None, notes, None]
        except ResumeError as e:
            choice = [None, [], str(e)]
    broadcast_object_list(choice)
    if choice[2] is not None:
        raise ResumeError(choice[2])
    return (Path(choice[0]) if choice[0] else None), choice[1]


def check_resumed_recipe(ckpt: Path, recipe: Recipe, force: bool, batching_may_change: bool = False) -> list[str]:
    """The training-relevant fields that differ from the checkpoint's recipe (`key: old -> new`): refused, or with
    `force` returned (to apply and print), except those that cannot take effect in a resumed run.
    `batching_may_change`: on another number of processes with the same global batch (checked by `world.py`),
    `data.batch_size` and `train.grad_accum` are how the batch is dealt out, not a change of the run."""
    diff = recipe_diff(checkpoint_recipe(ckpt), recipe.to_dict())
    if batching_may_change:
        diff = [line for line in diff if not line.startswith(("data.batch_size:", "train.grad_accum:"))]
    fixed = [line for line in diff if line.startswith(FIXED_ON_RESUME) and "dropout" not in line.split(":")[0]]
    if fixed:
        raise ResumeError(f"{', '.join(line.split(':')[0] for line in fixed)} cannot change when resuming, even with "
                          f"--force: the checkpoint's weights and random states come from the old value(s) "
                          f"({'; '.join(fixed)}); start a new run instead")
    if optimizer := next((line for line in diff if line.startswith("optim.name:")), None):
        raise ResumeError(f"optim.name cannot change when resuming, even with --force: the checkpoint holds the old "
                          f"optimizer's state ({optimizer}); start a new run from its weights instead (s4accel "
                          f"export, then model.pretrained)")
    if diff and not force:
        raise ResumeError(f"the recipe differs from the one {ckpt} was trained with (resume with --force to accept):\n"
                          + "\n".join(f"  {line}" for line in diff))
    return diff


def check_time_left(ckpt: Path, recipe: Recipe) -> None:
    """A run resumed with its `train.max_time` spent is refused before anything is built: it would stop after one
    more step. The loop's counters are read from the checkpoint as plain data (`weights_only`)."""
    limit = recipe.train.max_time_s
    if limit is None:
        return
    for path in sorted(ckpt.glob("custom_checkpoint_*.pkl")):
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # not this one's to judge: loading the checkpoint names a damaged file
            continue
        if isinstance(saved, dict) and {"run_id", "recipe_hash", "step"} <= saved.keys():  # TrainState
            spent = float(saved.get("train_seconds", 0.0))
            if spent >= limit:
                raise ResumeError(f"train.max_time {spoken(limit)} is spent: the run trained {spoken(spent)} to "
                                  f"step {saved['step']}; raise it to train on (--set "
                                  f"train.max_time={spoken(limit + max(3600.0, limit))})")
            return


FIXED_ON_RESUME = ("run.seed", "model.", "task.target", "train.state.", "data.tokenizer", "data.vocab_size")
"""Recipe fields a resumed run cannot honour: the weights' shapes and meaning, the random streams, the task."""


def load_checkpoint(accelerator, ckpt: Path, n_saved: int, other_world: bool = False) -> None:
    """`accelerator.load_state` after checks it does not make: the files this run needs are all there, nothing in
    them is more than tensors and plain data (checked before anything is unpickled), and any error while loading is
    one line (Accelerate would swallow a damaged RNG state with a log message). `other_world`: saved by another
    number of processes (accepted by `world.py`), so this process may have no random states of its own there."""
    found = len(list(ckpt.glob("custom_checkpoint_*.pkl")))
    if found != n_saved:
        raise ResumeError(f"{ckpt}: the checkpoint saved {found} objects besides model and optimizer, this run has "
                          f"{n_saved} (schedulers, loop state, carried state, stateful callbacks: a callback added or "
                          f"removed?)")
    ranks = len(list(ckpt.glob("random_states_*.pkl")))
    # Decided alike on every process (not only on those lacking their file), so that all stop here together: a
    # process left to go on alone into load_state ends in a collective whose peer has gone (a gloo traceback).
    if not other_world and ranks != accelerator.num_processes:
        raise ResumeError(f"{ckpt}: saved by {ranks} process(es), resumed by {accelerator.num_processes}: process "
                          f"{ranks} has no random states to continue from")
    check_pickles(ckpt)
    try:
        accelerator.load_state(str(ckpt))  # model, optimizer, RNG states of every process, and the objects above
    except ResumeError:  # a registered object refused its saved state, saying why
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ResumeError(f"could not load checkpoint {ckpt}: {type(e).__name__}: {first[:300]}") from None


def hyperparameters(optimizers: list[TrainOptimizer]) -> list:
    """Each optimizer's group settings (lr, weight decay, betas, ...) and its schedule's base rates, as built."""
    return [([{k: v for k, v in g.items() if k != "params"} for g in o.optimizer.param_groups],
             list(getattr(o.scheduler, "base_lrs", []))) for o in optimizers]


def restore_hyperparameters(optimizers: list[TrainOptimizer], fresh: list) -> None:
    """After `load_state`, which restores the checkpoint's optimizer settings and base learning rates: the recipe's
    settings again, and the learning rate its schedule gives at the restored step."""
    for o, (groups, base_lrs) in zip(optimizers, fresh):
        sched = o.scheduler
        for group, settings in zip(o.optimizer.param_groups, groups):
            group.update(settings)
        if not base_lrs:
            continue
        sched.base_lrs = base_lrs
        for group, base in zip(o.optimizer.param_groups, base_lrs):
            group["initial_lr"] = base
        if hasattr(sched, "lr_lambdas"):  # LambdaLR (every transformers schedule): lr = base * f(step)
            lrs = [base * f(sched.last_epoch) for base, f in zip(base_lrs, sched.lr_lambdas)]
        elif hasattr(sched, "_get_closed_form_lr"):
            lrs = sched._get_closed_form_lr()
        else:
            continue
        for group, lr in zip(o.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = list(lrs)


def resume_from(accelerator, ckpt: Path, saved: list, optimizers: list[TrainOptimizer], changed: list[str],
                other_world: bool = False) -> None:
    """Load the checkpoint into model, optimizers and the registered objects `saved`; with `--force` changes, the
    recipe's optimizer settings and schedule replace the checkpoint's (and the changes are printed)."""
    fresh = hyperparameters(optimizers)
    load_checkpoint(accelerator, ckpt, len(saved), other_world)
    if changed:  # --force: what the recipe now says is what runs from here on
        restore_hyperparameters(optimizers, fresh)
        accelerator.print(f"resuming with changed fields (--force): {'; '.join(changed)}")
    step = next(obj.step for obj in saved if isinstance(obj, TrainState))
    accelerator.print(f"resumed from {ckpt} at step {step}")
