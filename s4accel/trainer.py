"""`train(recipe)`: one Accelerator loop for any task (s4accel/tasks.py).

The task builds data, model and optimizers and says what a training step and a validation batch compute; the built-in
tasks know their models only through the transformers interface (`loss`, `aux_loss`, `logits`, `generate()`,
`save_pretrained`). Traps this loop avoids are numbered as in shared NOTES.md (N1 = item 1, ...).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import math
import os
import resource
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import psutil
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import GradientAccumulationPlugin, TorchDynamoPlugin, set_seed
from tqdm.auto import tqdm

from .callbacks import EMA, CallbackList, EarlyStopping, KeepBest, RunContext, improved, load_callback
from .checkpoint import (TrainState, check_pickles, checkpoint_recipe, checkpoint_step, latest_complete,
                         locate_checkpoint, move_aside, own_class, save_checkpoint, write_atomic)
from .config import Recipe, flatten, load_recipe, recipe_diff, training_fields
from .errors import NonFiniteError, RecipeError, ResumeError
from .preemption import StopSignals
from .run_dir import RunDir
from .tasks import Task, TrainOptimizer, count_items, load_task
from .tracking import build_trackers, check_tracker_kwargs


@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path | None
    """The exported model; None when the run was interrupted (preempted) before its end."""
    steps: int
    eval_metrics: dict = field(default_factory=dict)
    """The last evaluation: loss (nats/token), ppl, bits_per_byte, bits_per_char (and ema_* with train.ema)."""
    loop_seconds: float = 0.0
    """Wall time of the training loop (steps, logging, evaluation, checkpoints), without setup and export."""
    samples: list[str] = field(default_factory=list)
    is_main_process: bool = True
    stop_reason: str | None = None
    """Why training ended before train.max_steps (a signal, early stopping, a callback); None if it ran to the end."""
    checkpoint: Path | None = None
    """The last checkpoint written."""
    preempted: bool = False
    """Stopped by SIGTERM/SIGINT: a checkpoint was saved and `--resume` continues the run."""


def train(recipe: Recipe | str | Path, overrides: list[str] | tuple[str, ...] = (), resume: str | None = None,
          force: bool = False) -> TrainResult:
    """Train the model a recipe describes; returns where it went and how it did. Works under `accelerate launch`.

    resume: `"latest"` continues from the newest complete checkpoint of the run directory (or starts fresh when there
        is none), a path continues from that checkpoint. The continuation is exact: the same batches, RNG states and
        counters as a run that never stopped.
    force: resume even though training-relevant recipe fields differ from the checkpoint's recipe.
    """
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, overrides)
    cfg, run_dir, recipe_yaml = recipe.train, recipe.run.dir, recipe.to_yaml()
    task = load_task(recipe)  # imported and constructed first: its errors are recipe errors, before any compute
    check_tracker_kwargs(recipe.log)
    if cfg.tf32 and torch.cuda.is_available():  # before any CUDA work; Ampere and newer
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    # 0. What to resume: the main process verifies the checkpoints (every file against its checksum), moves invalid
    # ones aside, and every process follows its choice; a changed recipe is refused before anything is built.
    PartialState(cpu=not torch.accelerator.is_available())  # the process group, so that one process decides for all
    ckpt, notes = choose_checkpoint(run_dir, resume)
    changed = check_resumed_recipe(ckpt, recipe, force) if ckpt is not None else []
    accelerator = Accelerator(
        # Without any accelerator, processes started by `accelerate launch --multi_gpu` (torchrun) must be told they
        # are CPU processes, or each runs alone; with cpu=True they form a gloo group (DistributedType.MULTI_CPU).
        cpu=not torch.accelerator.is_available(),
        mixed_precision=cfg.mixed_precision,  # None: from the accelerate config / launch flags
        # We hand accumulate() exactly grad_accum micro-batches per optimizer step, across epoch boundaries too.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False),
        # The same order on every rank; a resumed epoch replays exactly the batches of an uninterrupted one.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        log_with=build_trackers(recipe.log.log_with, recipe.run.name, run_dir,
                                resume_step=checkpoint_step(ckpt) if ckpt else None,
                                kwargs=recipe.log.tracker_kwargs, retries=recipe.log.tracker_retries,
                                backoff_s=recipe.log.tracker_backoff_s) or None,
        project_dir=str(run_dir),
        step_scheduler_with_optimizer=False,
        # torch.compile in prepare(), after DDP wrapping; each distinct repeated block compiled once (regional).
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode=cfg.compile_mode, use_regional_compilation=True)
        if cfg.compile else None,  # None: from the accelerate config / launch flags
    )
    for note in notes:
        accelerator.print(f"warning: {note}")
    for kind in ("FSDP", "DEEPSPEED"):  # Accelerate 1.15 selects them only on GPUs; on CPU processes it runs DDP
        if os.environ.get(f"ACCELERATE_USE_{kind}", "").lower() == "true" and accelerator.distributed_type != kind:
            accelerator.print(f"warning: the accelerate config asks for {kind}, but Accelerate runs "
                              f"{accelerator.distributed_type.value} here (it uses {kind} only on GPUs)")
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        warnings.warn("fp16 mixed precision has no effect on CPU (Accelerate runs float32 there, without a "
                      "GradScaler); use train.mixed_precision=bf16 for half precision on CPU", stacklevel=2)
    run_files = RunDir(run_dir, accelerator.is_main_process, resuming=ckpt is not None,
                       resume_requested=resume is not None, overwrite=recipe.run.overwrite)
    if (note := run_files.check()) is not None:  # a directory holding another run: refused, or kept aside
        accelerator.print(f"warning: {note}")
    set_seed(recipe.run.seed)
    callbacks = build_callbacks(recipe)  # user callbacks are imported here: their errors come before any compute

    # 1. Data, model, optimizers, loaders: all built before anything is written into the run directory. The main
    # process tokenises (and trains a BPE, into the staging folder) first; the others read its cache.
    task.accelerator, task.run_dir, task.build_dir = accelerator, run_dir, run_files.build_dir
    with run_files.building():
        with accelerator.main_process_first():
            data = task.task_data = task.build_data()
        model = build_model(task, recipe)
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        optimizers = check_optimizers(task.build_optimizers(model), task)  # schedulers are not prepared (N3)
        train_dl, val_dl = task.dataloaders(data)
    run_files.commit(recipe_yaml)  # an earlier run's outputs moved aside, the staged files moved in
    accelerator.wait_for_everyone()
    model, optimizers, train_dl, val_dl = prepare(accelerator, task, model, optimizers, train_dl, val_dl)
    task.optimizers = {o.name: o for o in optimizers}
    optimizer, scheduler = optimizers[0].optimizer, optimizers[0].scheduler  # what callbacks see as run.optimizer
    if cfg.grad_accum > len(train_dl):
        warnings.warn(f"train.grad_accum={cfg.grad_accum} micro-batches are more than the {len(train_dl)} batches of "
                      f"an epoch (per process): each optimizer step spans more than one epoch", stacklevel=2)
    state = TrainState(recipe_hash=recipe_hash(recipe))
    # Registration order is the checkpoint format: schedulers, loop counters, the task's own state (the carried
    # state of stateful training), then stateful callbacks in list order.
    saved = [*(o.scheduler for o in optimizers), state, *task.stateful(), *callbacks.stateful()]
    accelerator.register_for_checkpointing(*saved)
    if ckpt is not None:
        fresh = hyperparameters(optimizers)
        load_checkpoint(accelerator, ckpt, len(saved))
        if changed:  # --force: what the recipe now says is what runs from here on
            restore_hyperparameters(optimizers, fresh)
            accelerator.print(f"resuming with changed fields (--force): {'; '.join(changed)}")
        accelerator.print(f"resumed from {ckpt} at step {state.step}")
    signals = StopSignals()

    def eval_fn(m):  # gathered metrics of any model copy; None if a stop signal interrupted it
        return evaluate(accelerator, task, m, val_dl, abort=lambda: signals.received is not None)

    run = RunContext(accelerator, model, optimizer, scheduler, state, recipe, run_dir, data.tokenizer, eval_fn,
                     task.export, task=task, optimizers=optimizers)
    callbacks.on_train_start(run)
    accelerator.init_trackers(recipe.run.name, config={**{k: "null" if v is None else v for k, v in
                                                          flatten(recipe.to_dict()).items()}, "run_id": state.run_id})
    n_train, n_val = (len(split) if n is None else n for split, n in ((data.train, data.n_train),
                                                                      (data.val, data.n_val)))
    accelerator.print(f"{recipe.run.name} ({type(task).__name__}): {count_params(model):,} parameters, {n_train:,} "
                      f"train / {n_val:,} val {data.unit}, {accelerator.num_processes} process(es) on "
                      f"{accelerator.device} ({accelerator.distributed_type.value}), mixed precision "
                      f"{accelerator.mixed_precision}")
    run_files.drop_replaced()  # the new run has started: the outputs it replaces go

    # 2. The loop: one iteration per optimizer step.
    batches = batch_stream(accelerator, train_dl, state)
    meter = Meter(accelerator, state, recipe.log.expert_idle_warn_steps)
    bar = tqdm(total=cfg.max_steps, initial=state.step, desc="train", dynamic_ncols=True,
               disable=not (accelerator.is_main_process and recipe.log.progress_bar))
    params = [p for p in model.parameters() if p.requires_grad]  # what clipping sees, listed once
    save_clock = Clock(recipe.checkpoint.every_minutes)
    eval_metrics, last_ckpt, stop_reason, preempted = {}, ckpt, None, False
    interrupted = lambda: signals.received is not None  # noqa: E731
    model.train()
    # The ~10^5 long-lived objects of setup (dataset, tokenizer, modules, recipe) go to the permanent generation:
    # otherwise each full collection the loop's garbage triggers rescans them all (0.2 s here, a 13% slower loop).
    gc.collect()
    gc.freeze()
    t_start = time.perf_counter()
    with signals, unfreeze_gc_after():
        while state.step < cfg.max_steps and stop_reason is None:
            # A stop signal between micro-batches abandons the window and rewinds to the last complete step, so a
            # long accumulation window does not keep the cluster waiting (grad_accum > 1 only).
            rewind = Rewind(accelerator, state, task) if cfg.grad_accum > 1 else None
            window = [next(batches) for _ in range(cfg.grad_accum)]
            step_fn = backward_window if task.automatic_optimization else manual_window
            scalars = step_fn(accelerator, model, window, task, state.step, abort=interrupted if rewind else None)
            if scalars is None:  # the signal came mid-window: save the state of the last complete step and leave
                rewind(optimizers)
                stop_reason, preempted = f"received {signals.received or 'a stop signal on another process'}", True
                last_ckpt = save_checked(accelerator, model, run_dir, state.step, recipe, recipe_yaml)
                break
            if task.automatic_optimization:
                # The window's last micro-batch synchronised the gradients: all below happens once per step (N1).
                norm = clip_gradients(accelerator, params, cfg)
                if norm is not None:  # None under DeepSpeed, which clips inside its engine and keeps the norm
                    scalars["grad_norm"] = norm
                objective = scalars["loss"] + scalars.get("aux_loss", 0)
                nonfinite = ~torch.isfinite(objective + scalars.get("grad_norm", 0))
            else:  # the task stepped its optimizers itself, on the window's last micro-batch
                nonfinite = torch.tensor(task.nonfinite_steps > 0)
            # One check per step, the same decision on every process (N10): bad numbers, a stop, a save due by time.
            flags = agree(accelerator, nonfinite, signal=interrupted(), stop=run.stop_reason is not None,
                          save=save_clock.due())
            if flags.nonfinite:
                skip_nonfinite_step(accelerator, model, optimizers, state, recipe, recipe_yaml)
                continue
            if task.automatic_optimization:
                for o in optimizers:
                    optimizer_step(accelerator, o.optimizer, o.scheduler, state)
            state.consecutive_nonfinite = 0
            state.step += 1
            state.tokens_seen += sum(task.count_units(b) for b in window) * accelerator.num_processes
            meter.add(**scalars)
            bar.update(1)
            callbacks.on_step_end(run)
            if state.step % recipe.log.log_every == 0 or state.step == cfg.max_steps:
                logs = meter.flush(optimizers)  # the loop's only host sync besides agree() (N11)
                accelerator.log(logs, step=state.step)
                callbacks.on_log(run, logs)
                bar.set_postfix({k[6:]: f"{v:.3f}" for k, v in logs.items() if k.endswith("loss")}, refresh=False)
            if (cfg.eval_every and state.step % cfg.eval_every == 0) or state.step == cfg.max_steps:
                eval_metrics = evaluate_and_report(run, callbacks, bar) or eval_metrics
                task.on_validation_end()
                flags = flags.merge(agree(accelerator, None, signal=interrupted(), stop=run.stop_reason is not None))
            if flags.signal or flags.stop:  # every process takes this branch at the same step
                preempted = flags.signal
                stop_reason = (f"received {signals.received or 'a stop signal on another process'}" if preempted
                               else run.stop_reason or "a callback on another process asked to stop")
            every = recipe.checkpoint.every_steps
            if (every and state.step % every == 0) or flags.save or stop_reason:
                last_ckpt = save_checked(accelerator, model, run_dir, state.step, recipe, recipe_yaml)
                callbacks.on_save(run, last_ckpt)
                save_clock.reset()
    bar.close()
    loop_seconds = time.perf_counter() - t_start
    result = TrainResult(run_dir, None, state.step, eval_metrics, loop_seconds, [], accelerator.is_main_process,
                         stop_reason, last_ckpt, preempted)
    if not result.preempted:  # the cluster wants the machine back when preempted: the checkpoint is written, leave
        # 3. Export: config + safetensors + generation config + tokenizer, loadable by from_pretrained.
        result.final_dir = run_dir / "final"
        task.export(model, result.final_dir)
        task.on_train_end(model)  # the language model writes its samples
        result.samples = getattr(task, "samples", [])
        callbacks.on_train_end(run)  # writes final_ema/ and the like before a push reads them
    # 4. Every process leaves together: the wrapped model (its DDP reducer holds the process group) is freed while
    # all processes are still here, then the group is destroyed. Freed later, after one process had exited, the
    # reducer's gloo group waited forever for it at exit.
    del model, run, params
    task.optimizers = {}
    finish(accelerator)
    if not result.preempted and recipe.hub.push_at_end and accelerator.is_main_process:  # a failed push loses nothing
        from .hub import push_run

        hub = recipe.hub
        url = push_run(run_dir, hub.repo_id, private=hub.private, revision=hub.revision, which=hub.which)
        accelerator.print(f"pushed the {hub.which} model to {hub.repo_id}: {url}")
    return result


def finish(accelerator) -> None:
    """Barrier, release what Accelerate holds of the prepared objects, collect, then end training (trackers closed,
    process group destroyed) on every process together."""
    accelerator.wait_for_everyone()
    accelerator.free_memory()  # its references to the prepared model, optimizers and loaders
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


def choose_checkpoint(run_dir: Path, resume: str | None) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (None: a fresh start) and warnings, decided by the main process and the same on
    every process. Checkpoints newer than the chosen one that failed verification are moved aside."""
    from accelerate.utils import broadcast_object_list

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


def check_resumed_recipe(ckpt: Path, recipe: Recipe, force: bool) -> list[str]:
    """The training-relevant fields that differ from the checkpoint's recipe (`key: old -> new`): refused, or with
    `force` returned (to apply and print), except those that cannot take effect in a resumed run."""
    diff = recipe_diff(checkpoint_recipe(ckpt), recipe.to_dict())
    fixed = [line for line in diff if line.startswith(FIXED_ON_RESUME) and "dropout" not in line.split(":")[0]]
    if fixed:
        raise ResumeError(f"{', '.join(line.split(':')[0] for line in fixed)} cannot change when resuming, even with "
                          f"--force: the checkpoint's weights and random states come from the old value(s) "
                          f"({'; '.join(fixed)}); start a new run instead")
    if diff and not force:
        raise ResumeError(f"the recipe differs from the one {ckpt} was trained with (resume with --force to accept):\n"
                          + "\n".join(f"  {line}" for line in diff))
    return diff


FIXED_ON_RESUME = ("run.seed", "model.", "task.target", "train.state.", "data.tokenizer", "data.vocab_size")
"""Recipe fields a resumed run cannot honour: the weights' shapes and meaning, the random streams, the task."""


def load_checkpoint(accelerator, ckpt: Path, n_saved: int) -> None:
    """`accelerator.load_state` after checks it does not make: the files this run needs are all there, nothing in
    them is more than tensors and plain data (checked before anything is unpickled), and any error while loading is
    one line (Accelerate would swallow a damaged RNG state with a log message)."""
    found = len(list(ckpt.glob("custom_checkpoint_*.pkl")))
    if found != n_saved:
        raise ResumeError(f"{ckpt}: the checkpoint saved {found} objects besides model and optimizer, this run has "
                          f"{n_saved} (schedulers, loop state, carried state, stateful callbacks: a callback added or "
                          f"removed?)")
    ranks = len(list(ckpt.glob("random_states_*.pkl")))
    if not (ckpt / f"random_states_{accelerator.process_index}.pkl").is_file():
        raise ResumeError(f"{ckpt}: saved by {ranks} process(es), resumed by {accelerator.num_processes}: process "
                          f"{accelerator.process_index} has no random states to continue from")
    check_pickles(ckpt)
    try:
        accelerator.load_state(str(ckpt))  # model, optimizer, RNG states of every process, and the objects above
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


class Rewind:
    """What one optimizer step's window changes besides gradients (the data position, the random streams, a
    task's carried state), captured at its start, to go back to the last complete step when a stop signal cuts the
    window short: the checkpoint then holds exactly the state a step boundary would have."""

    def __init__(self, accelerator, state: TrainState, task: Task):
        import random

        import numpy as np

        self.accelerator, self.state, self.task = accelerator, state, task
        # accelerate counts micro-batches to know which one synchronises gradients, and saves that count
        self.position = (state.epoch, state.batch_in_epoch, accelerator.step)
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        self.carried = [(obj, obj.snapshot()) for obj in task.stateful() if hasattr(obj, "snapshot")]

    def __call__(self, optimizers: list[TrainOptimizer]) -> None:
        import random

        import numpy as np

        for o in optimizers:
            o.optimizer.zero_grad(set_to_none=True)
        self.state.epoch, self.state.batch_in_epoch, self.accelerator.step = self.position
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        if self.rng[3] is not None:
            torch.cuda.set_rng_state_all(self.rng[3])
        for obj, snap in self.carried:
            obj.restore(snap)


def build_model(task: Task, recipe: Recipe):
    """The task's model; a model too large for the memory is a recipe error naming the size, not a traceback."""
    try:
        return task.build_model()
    except (RuntimeError, MemoryError) as e:
        text = str(e)
        if isinstance(e, RuntimeError) and "alloc" not in text.lower() and "memory" not in text.lower():
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        raise RecipeError(f"model: cannot allocate {recipe.model.name} with model.overrides {recipe.model.overrides} "
                          f"({first[:200]}); choose a smaller size") from None


def weights_finite(accelerator, model) -> bool:
    """Whether every parameter is finite on every process (one norm per tensor, one small all-reduce)."""
    from .callbacks import local

    tensors = [local(p) for p in model.parameters()]
    ok = torch.stack(torch._foreach_norm(tensors)).isfinite().all() if tensors else torch.tensor(True)
    return not agree(accelerator, ~ok.to(accelerator.device)).nonfinite


def save_checked(accelerator, model, run_dir: Path, step: int, recipe: Recipe, recipe_yaml: str) -> Path:
    """A checkpoint of weights that are finite: an update that made them non-finite (a learning rate too large) is
    stopped here rather than saved as the state to resume from."""
    if not weights_finite(accelerator, model):
        good = latest_complete(run_dir)
        raise NonFiniteError(f"the weights are no longer finite after step {step} (an update made them so: optim.lr "
                             f"too large?); not saving them; the last good state is "
                             f"{good or 'not saved (no checkpoint yet)'}")
    return save_checkpoint(accelerator, run_dir, step, recipe.checkpoint.keep_last, recipe_yaml)


def build_callbacks(recipe: Recipe) -> CallbackList:
    """Built-ins first, in a fixed order (EMA adds its metrics before the others read them), then the recipe's."""
    ema = EMA(**recipe.train.ema.model_dump()) if recipe.train.ema is not None else None
    cbs = [ema] if ema else []
    if recipe.train.early_stopping is not None:
        cbs.append(EarlyStopping(**recipe.train.early_stopping.model_dump()))
    ck = recipe.checkpoint
    if ck.keep_best:
        cbs.append(KeepBest(ck.keep_best, ck.best_metric, ck.best_mode, ema=ema))
    cbs += [load_callback(c.target, c.args, f"callbacks.{i}") for i, c in enumerate(recipe.callbacks)]
    return CallbackList(cbs)


def recipe_hash(recipe: Recipe) -> str:
    return hashlib.sha256(json.dumps(training_fields(recipe.to_dict()), sort_keys=True).encode()).hexdigest()[:16]


@contextlib.contextmanager
def unfreeze_gc_after():
    """Hand the objects `gc.freeze()` set aside back to the collector when the loop ends, however it ends."""
    try:
        yield
    finally:
        gc.unfreeze()


class Flags(NamedTuple):
    """What the processes agreed on at a step: some saw non-finite numbers, got a stop signal, have a callback
    asking to stop, have a time-based save due."""

    nonfinite: bool = False
    signal: bool = False
    stop: bool = False
    save: bool = False

    def merge(self, other: Flags) -> Flags:
        return Flags(*(a or b for a, b in zip(self, other)))


def agree(accelerator, nonfinite: torch.Tensor | None, signal=False, stop=False, save=False) -> Flags:
    """The flags of any process, the same on every process, so none of them breaks out of a collective alone (N10).
    One host sync for the non-finite check; one small all-reduce with several processes; nothing more on one."""
    if accelerator.num_processes == 1:
        return Flags(bool(nonfinite) if nonfinite is not None else False, signal, stop, save)
    flags = torch.tensor([0.0, signal, stop, save], device=accelerator.device)
    if nonfinite is not None:
        flags[0] = nonfinite.float()
    return Flags(*(v > 0 for v in accelerator.reduce(flags, reduction="sum").tolist()))


def skip_nonfinite_step(accelerator, model, optimizers: list[TrainOptimizer], state, recipe, recipe_yaml) -> None:
    """Drop this step's update (the weights stay the last good ones), count it, and stop by policy, or at once when
    the weights themselves are no longer finite (skipping cannot help then)."""
    cfg = recipe.train
    for o in optimizers:
        o.optimizer.zero_grad(set_to_none=True)
    state.nonfinite_skips += 1
    state.consecutive_nonfinite += 1
    accelerator.print(f"warning: non-finite loss or gradient norm at step {state.step + 1}; update skipped "
                      f"({state.consecutive_nonfinite} in a row)")
    finite = weights_finite(accelerator, model)
    if cfg.on_nonfinite == "stop" or state.consecutive_nonfinite >= cfg.max_nonfinite_skips or not finite:
        why = ("the weights are no longer finite: an update made them so (optim.lr too large?)" if not finite
               else "train.on_nonfinite=stop" if cfg.on_nonfinite == "stop"
               else f"{state.consecutive_nonfinite} in a row, train.max_nonfinite_skips={cfg.max_nonfinite_skips}")
        if finite:
            path = save_checkpoint(accelerator, recipe.run.dir, state.step, recipe.checkpoint.keep_last, recipe_yaml)
            where = f"saved in {path}"
        else:
            good = latest_complete(recipe.run.dir)
            where = f"{good}" if good else "not saved (no checkpoint yet)"
        raise NonFiniteError(f"non-finite loss or gradient norm at step {state.step + 1} ({why}); the last good state "
                             f"is {where}")


def evaluate_and_report(run: RunContext, callbacks: CallbackList, bar) -> dict | None:
    """Evaluate the model, let callbacks add to and act on the metrics (EMA, keep-best, early stopping), log them."""
    metrics = run.evaluate(run.model)
    if metrics is None:  # interrupted by a stop signal
        return None
    callbacks.on_eval_end(run, metrics)
    ck = run.recipe.checkpoint
    if ck.best_metric in metrics and improved(metrics[ck.best_metric], run.state.best_metric, ck.best_mode):
        run.state.best_metric = metrics[ck.best_metric]
    run.log({(f"eval_ema/{k[4:]}" if k.startswith("ema_") else f"eval/{k}"): v for k, v in metrics.items()})
    if run.accelerator.is_main_process:
        bar.write(f"step {run.state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


class Clock:
    """Time-based checkpoints: due every `minutes` of training (never when None)."""

    def __init__(self, minutes: float | None):
        self.seconds = None if minutes is None else 60 * minutes
        self.reset()

    def reset(self):
        self.start = time.monotonic()

    def due(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.start >= self.seconds


def enable_activation_checkpointing(model) -> None:
    """Each block recomputes its activations in the backward pass (transformers' `activation_checkpointing_enable`,
    non-reentrant `torch.utils.checkpoint`, which replays dropout's and the router jitter's RNG: same gradients)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    try:
        if enable is None:
            raise ValueError(f"{type(model).__name__} has no activation_checkpointing_enable()")
        enable()
    except ValueError as e:
        raise RecipeError(f"train.activation_checkpointing: {e}") from None


def check_optimizers(optimizers, task: Task) -> list[TrainOptimizer]:
    optimizers = list(optimizers)
    names = [o.name for o in optimizers if isinstance(o, TrainOptimizer)]
    if not optimizers or len(names) != len(optimizers) or len(set(names)) != len(names):
        raise RecipeError(f"{type(task).__name__}.build_optimizers must return a non-empty list of "
                          f"s4accel.tasks.TrainOptimizer with distinct names")
    return optimizers


def prepare(accelerator, task: Task, model, optimizers: list[TrainOptimizer], train_dl, val_dl):
    """Everything through `accelerator.prepare` in one call (DeepSpeed and FSDP need model and optimizers together),
    except: a stream loader of stateful training (fixed rows per process in text order; a sharded loader would
    interleave them, N14), and under manual optimisation the DDP wrapper (`Task.step` averages gradients itself)."""
    from accelerate.utils import DistributedType

    shard_train = task.prepare_train_loader
    objs = [*(o.optimizer for o in optimizers), *([train_dl] if shard_train else []), val_dl]
    if task.automatic_optimization:
        model, *objs = accelerator.prepare(model, *objs)
    else:
        if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU,
                                                DistributedType.MULTI_GPU):
            raise RecipeError(f"{type(task).__name__} uses manual optimisation, which supports one process or DDP, "
                              f"not {accelerator.distributed_type.value}")
        model = accelerator.prepare_model(model, evaluation_mode=True)  # placed and autocast, not wrapped in DDP
        objs = list(accelerator.prepare(*objs))
    optimizers = [TrainOptimizer(o.name, prepared, o.scheduler) for o, prepared in zip(optimizers, objs)]
    objs = objs[len(optimizers):]
    if shard_train:
        train_dl = objs.pop(0)
    return model, optimizers, train_dl, objs[0]


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def batch_stream(accelerator, train_dl, state: TrainState):
    """Micro-batches forever, epoch after epoch; `set_epoch` reshuffles each epoch identically on every rank. After a
    mid-epoch resume, the first epoch skips the batches the checkpointed run had consumed: with the seedable sampler
    this replays exactly the batches an uninterrupted run sees (N6)."""
    skip = state.batch_in_epoch
    while True:
        if hasattr(train_dl, "set_epoch"):  # a prepared (sharded, device-placing) loader
            train_dl.set_epoch(state.epoch)
            batches = accelerator.skip_first_batches(train_dl, skip) if skip else train_dl
        else:  # the stream loader of stateful training: in order, on the CPU
            batches = ({k: v.to(accelerator.device) for k, v in b.items()}
                       for b in itertools.islice(train_dl, skip, None))
        for batch in batches:
            state.batch_in_epoch += 1
            yield batch
        skip = 0
        state.epoch += 1
        state.batch_in_epoch = 0


def backward_window(accelerator, model, window: list[dict], task: Task | None = None, step: int = 0,
                    abort=None) -> dict | None:
    """Forward and backward over the micro-batches of one optimizer step (automatic optimisation); returns this rank's
    share of the window's training scalars (`loss`, and for mixture-of-experts models `aux_loss`, `expert_counts`,
    `dropped_counts`). Without a task, `model(**batch)` is the step. With `abort` (a stop signal's flag), every
    process checks it together between micro-batches and all return None as soon as one saw it, unless the window's
    end is near (the last eighth of it, at least its last micro-batch, is finished instead); one small collective per
    checked micro-batch with several processes, nothing with one.

    Item-normalised (N4): the task's loss is its micro-batch's mean over `count_items(batch)` (real target tokens for
    a language model); weighting it by that count over the count of the whole window on all ranks makes the window's
    gradient that of the mean over all its items, so ragged micro-batches weigh by their items. Multiplying by
    grad_accum x num_processes cancels backward's 1/grad_accum (N2) and DDP's mean over ranks. One collective.
    An `aux_loss` (router losses, included in the model's `loss`) is its own micro-batch's mean, so it is taken out
    of that weighting: backward's 1/grad_accum and DDP's mean make it the mean over the window's micro-batches.
    """
    ga, n_proc = accelerator.gradient_accumulation_steps, accelerator.num_processes
    assert len(window) == ga, f"a window holds grad_accum={ga} micro-batches, got {len(window)}"
    near = max(1, ga // 8)  # micro-batches still to run that are finished rather than abandoned
    count = task.count_items if task is not None else count_items
    counts, n_items = None, None  # one micro-batch on one process: the task's own mean is the window's mean
    if ga > 1 or n_proc > 1:
        counts = [count(b) for b in window]
        n_items = sum(counts)
        if n_proc > 1:
            n_items = accelerator.gather(n_items.reshape(1)).sum()
    totals: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(window):
        if i and abort is not None and ga - i > near and agree(accelerator, None, signal=abort()).signal:
            return None
        with accelerator.accumulate(model):  # no DDP all-reduce until the window's last micro-batch
            out = task.training_step(model, batch, step) if task is not None else model(**batch)
            loss, aux = (out, None) if isinstance(out, torch.Tensor) else (out["loss"], out.get("aux_loss"))
            mean = loss - aux if aux is not None else loss
            share = mean * (counts[i] / n_items) if n_items is not None else mean  # of the window's mean
            objective = share * (ga * n_proc)
            accelerator.backward(objective + aux if aux is not None else objective)
        parts = {"loss": share.detach()}
        if aux is not None:
            for key in ("aux_loss", "balance_loss", "z_loss"):  # summed over the window and ranks: the mean
                if out.get(key) is not None:
                    parts[key] = out[key].detach() / (ga * n_proc)
            for key in ("expert_counts", "dropped_counts"):
                if out.get(key) is not None:
                    parts[key] = out[key]
        for k, v in parts.items():
            totals[k] = totals[k] + v if k in totals else v
    return totals


def manual_window(accelerator, model, window: list[dict], task: Task, step: int, abort=None) -> dict | None:
    """Manual optimisation: the task's `training_step` runs on each micro-batch (its `step()` calls act on the last);
    returns this rank's share of the mean of the scalars it returned, and the gradient norms of its steps. `abort`:
    as for `backward_window` (no optimizer has stepped before the window's last micro-batch)."""
    ga, n_proc = accelerator.gradient_accumulation_steps, accelerator.num_processes
    near = max(1, ga // 8)
    task.window_scalars, task.nonfinite_steps = {}, 0
    totals: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(window):
        if i and abort is not None and ga - i > near and agree(accelerator, None, signal=abort()).signal:
            return None
        with accelerator.accumulate(model):  # sets sync_gradients on the window's last micro-batch
            out = task.training_step(model, batch, step) or {}
        for k, v in out.items():
            v = torch.as_tensor(v).detach().float() / (ga * n_proc)
            totals[k] = totals[k] + v if k in totals else v
    return {**totals, **task.window_scalars}


def optimizer_step(accelerator, optimizer, scheduler, state: TrainState) -> None:
    """Step the optimizer, then the schedule unless fp16's GradScaler skipped the step (inf/NaN gradients): a skipped
    step is counted and must not advance the learning rate (N3)."""
    optimizer.step()
    if accelerator.optimizer_step_was_skipped:
        state.scaler_skips += 1
    else:
        scheduler.step()
    state.consecutive_nonfinite = 0
    optimizer.zero_grad(set_to_none=True)


def clip_gradients(accelerator, params: list, cfg) -> torch.Tensor:
    """Clip by value or by norm; return the global gradient norm (before norm clipping) for logging."""
    if cfg.clip_grad_value is not None:
        accelerator.clip_grad_value_(params, cfg.clip_grad_value)  # also unscales fp16 gradients
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    else:  # an infinite max norm only measures; clip_grad_norm_ unscales fp16 gradients once per step either way (N1)
        norm = accelerator.clip_grad_norm_(params, cfg.clip_grad_norm or math.inf)
    # Under FSDP2 the gradients are sharded DTensors and so is their norm: the full value, the same on every process.
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class Meter:
    """Sums training scalars on the device between log steps, so logging syncs with the host once per interval."""

    def __init__(self, accelerator, state: TrainState, expert_idle_warn_steps: int = 200):
        self.accelerator, self.state = accelerator, state
        self.process = psutil.Process()
        self.sums: dict[str, torch.Tensor] = {}
        self.steps_at_last = state.step
        self.time_at_last = time.perf_counter()
        self.tokens_at_last = state.tokens_seen
        self.experts = ExpertLoad(expert_idle_warn_steps, accelerator.is_main_process)

    def add(self, **values: torch.Tensor):
        for k, v in values.items():
            v = v.detach() if k in ("expert_counts", "dropped_counts") else v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def flush(self, optimizers: list[TrainOptimizer]) -> dict:
        state = self.state
        steps = state.step - self.steps_at_last
        logs = {}
        for key in [k for k in self.sums if k not in ("expert_counts", "dropped_counts")]:
            value = self.sums.pop(key)
            if not key.startswith("grad_norm"):  # each rank holds its share of the mean; norms are the same on all
                value = self.accelerator.reduce(value, reduction="sum")
            logs[f"train/{key}"] = value.item() / steps
        if "expert_counts" in self.sums:  # (n_moe, E) routed pairs, summed over the interval and every process
            counts = self.accelerator.reduce(self.sums.pop("expert_counts"), reduction="sum")
            dropped = self.accelerator.reduce(self.sums.pop("dropped_counts"), reduction="sum")
            logs.update(self.experts.update(counts, dropped, steps, state.step))
        now = time.perf_counter()
        logs["train/tokens_per_s"] = (state.tokens_seen - self.tokens_at_last) / (now - self.time_at_last)
        logs["train/step_time_ms"] = 1000 * (now - self.time_at_last) / steps
        logs["train/peak_mem_mb"] = peak_memory_mb(self.accelerator.device)
        logs["train/rss_mb"] = self.process.memory_info().rss / 2**20  # current, to see memory stay flat
        logs["train/epoch"] = state.epoch
        logs["train/nonfinite_skips"] = state.nonfinite_skips
        logs["train/scaler_skips"] = state.scaler_skips
        for o in optimizers:
            prefix = "" if len(optimizers) == 1 else f"{o.name}_"
            for i, (group, lr) in enumerate(zip(o.optimizer.param_groups, o.scheduler.get_last_lr())):
                logs[f"train/lr_{prefix}{group.get('name', i)}"] = lr
        self.sums.clear()
        self.steps_at_last, self.time_at_last, self.tokens_at_last = state.step, now, state.tokens_seen
        return logs


class ExpertLoad:
    """Mixture-of-experts routing statistics for the logs: each expert's share of its layer's routed (token, expert)
    pairs, the fraction of pairs dropped by the capacity limit, and a warning when an expert has received nothing
    for `warn_steps` optimizer steps (a dead expert: the router sends it no token, so it never learns)."""

    def __init__(self, warn_steps: int, warn: bool = True):
        self.warn_steps, self.warn = warn_steps, warn  # every process computes the same; one warns
        self.idle: torch.Tensor | None = None  # (n_moe, E): steps since each expert last received a pair
        self.warned: set[tuple[int, int]] = set()

    def update(self, counts: torch.Tensor, dropped: torch.Tensor, steps: int, step: int) -> dict:
        counts, dropped = counts.double().cpu(), dropped.double().cpu()
        totals = counts.sum(-1)  # (n_moe,)
        share = counts / totals.clamp(min=1)[:, None]
        logs = {f"moe/load/layer{i}/expert{e}": share[i, e].item()
                for i in range(share.shape[0]) for e in range(share.shape[1])}
        logs["moe/routed_pairs"] = totals.sum().item()  # all layers, all processes, this interval
        logs["moe/dropped_fraction"] = (dropped.sum() / totals.sum().clamp(min=1)).item()
        logs["moe/max_load"] = share.max().item()  # 1/E when balanced
        logs["moe/idle_experts"] = int((counts == 0).sum())
        idle = torch.zeros_like(counts) if self.idle is None else self.idle
        self.idle = torch.where(counts == 0, idle + steps, torch.zeros_like(idle))
        for i, e in (self.idle >= self.warn_steps).nonzero().tolist():
            if (i, e) not in self.warned:
                self.warned.add((i, e))
                if self.warn:
                    warnings.warn(f"step {step}: expert {e} of MoE layer {i} has received no token for "
                                  f"{int(self.idle[i, e])} steps (a dead expert); consider a larger "
                                  "router_aux_loss_coef", stacklevel=2)
        self.warned = {(i, e) for i, e in self.warned if self.idle[i, e] > 0}  # warn again if it dies again
        return logs


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak resident set size (Linux: KiB)


@torch.no_grad()
def gathered_sums(accelerator, model, val_dl, per_sample, abort=lambda: False) -> tuple[dict, int] | None:
    """Sum `per_sample(model, batch) -> {name: (B,) or (B, k)}` over the whole evaluation split on all processes (N5):
    the rows go through `gather_for_metrics`, which drops the duplicates padding the last batch. Returns the sums
    (floats, or lists for (B, k) values) and the number of samples; None when `abort()` (a stop signal) becomes true on
    any process, checked before each batch.

    The training RNG streams come out untouched (each new DataLoader iterator draws a seed from the global RNG):
    how often a run evaluates, and whether an evaluation was cut short, never changes what training computes."""
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        was_training = model.training
        model.eval()
        totals, widths = None, None
        try:
            for batch in val_dl:
                if agree(accelerator, None, signal=abort()).signal:
                    return None
                with accelerator.autocast():  # a model copy that did not go through prepare() (EMA) gets it too
                    values = per_sample(model, batch)
                    cols = [v.reshape(v.shape[0], -1).double() for v in values.values()]
                    cols.append(torch.ones_like(cols[0][:, :1]))  # counts the samples
                    rows = accelerator.gather_for_metrics(torch.cat(cols, dim=1)).sum(0)
                widths = widths or {k: c.shape[1] for k, c in zip(values, cols)}
                totals = rows if totals is None else totals + rows
        finally:
            model.train(was_training)
    if totals is None:
        raise ValueError("the validation loader yielded no batch")
    parts = totals.tolist()
    sums, i = {}, 0
    for key, width in widths.items():
        sums[key] = parts[i] if width == 1 and values[key].dim() == 1 else parts[i : i + width]
        i += width
    return sums, int(parts[-1])


def evaluate(accelerator, task: Task, model, val_dl, abort=lambda: False) -> dict | None:
    """The task's metrics over the whole validation split, gathered over processes (None if a stop cut it short)."""
    out = gathered_sums(accelerator, model, val_dl, task.validation_step, abort)
    return None if out is None else task.compute_metrics(*out)


def write_samples(accelerator, model, tokenizer, recipe: Recipe, run_dir: Path) -> list[str]:
    """Complete the recipe's prompts with `generate()` on the main process; write them to `samples.txt`. Call on
    every process: a model sharded by FSDP is gathered into a whole copy for the main process first."""
    cfg = recipe.sample
    if not cfg.prompts:
        return []
    lm = accelerator.unwrap_model(model)
    if isinstance(lm, FSDPModule):
        full = accelerator.get_state_dict(model)  # collective; the full tensors land on the main process
        lm = own_class(lm, full, device=accelerator.device)[0] if accelerator.is_main_process else None
    if not accelerator.is_main_process:
        return []
    lm.eval()
    torch.manual_seed(cfg.seed)
    samples = []
    for prompt in cfg.prompts:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(accelerator.device)
        sampling = {"do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k or 0}
        with accelerator.autocast():
            out = lm.generate(ids, max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              **(sampling if cfg.temperature > 0 else {"do_sample": False}))
        samples.append(tokenizer.decode(out[0], skip_special_tokens=True))
    write_atomic(run_dir / "samples.txt", "\n\n".join(f"--- sample {i}\n{s}" for i, s in enumerate(samples)) + "\n")
    for s in samples:
        accelerator.print(f"--- sample\n{s}")
    return samples
