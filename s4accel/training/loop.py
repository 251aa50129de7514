"""`train(recipe)`: one Accelerator loop for any task (`task.py`).

The task builds data, model and optimizers and says what a training step and a validation batch compute; the built-in
tasks know their models only through the transformers interface (`loss`, `aux_loss`, `logits`, `generate()`,
`save_pretrained`). Read `train()` first: setup in named helpers, the loop one optimizer step per iteration (`step.py`
holds the step itself), then export and a clean exit.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm

from ..config import Recipe, load_recipe
from ..config.durations import spoken
from ..errors import RecipeError
from .callbacks import EMA, CallbackList, EarlyStopping, KeepBest, RunContext, best_model, load_callback
from .devices import context_parallel, graphs
from .devices.precision import convolution_line
from .devices.zero import precision
from .ending import finish
from .evaluate import eval_at_start, eval_sets_note, evaluate, evaluate_and_report, evaluation_schedule
from .observe.console import RUN_LOG, processes_line, quiet_libraries
from .observe.metrics import Meter
from .observe.profiling import Profile
from .observe.tracking import check_tracker_kwargs, check_tracker_packages, check_tracker_stores, tracker_config
from .runs.checkpoint import TrainState
from .runs.preemption import StopSignals
from .runs.resume import check_resumed_recipe, check_time_left, choose_checkpoint, recipe_hash, resume_from
from .runs.run_dir import RunDir, with_version
from .runs.run_lock import RunLock
from .runs.world import World, launch_asked_for, move_to_world, plan_world_change
from .setup import CPU, build_run, make_accelerator
from .step import Stepper, agree, batch_stream, save_checked
from .task import Task, TrainOptimizer, load_task


@dataclass(kw_only=True)
class TrainResult:
    run_dir: Path
    final_dir: Path | None
    """The exported model; None when the run was interrupted (preempted) before its end."""
    steps: int
    eval_metrics: dict = field(default_factory=dict)
    """The last evaluation: loss (nats/token), ppl, bits_per_byte, bits_per_char (and ema_* with train.ema)."""
    loop_seconds: float = 0.0
    """Wall time of the training loop (steps, logging, evaluation, checkpoints), without setup and export."""
    throughput: dict = field(default_factory=dict)
    """Over the loop: `tflops` (model TFLOP/s of training, all processes) and `mfu` (their share of the devices'
    peak), for s4accel's own model families."""
    samples: list[str] = field(default_factory=list)
    is_main_process: bool = True
    stop_reason: str | None = None
    """Why training ended early (a signal, early stopping, a callback); None if it ran to the end."""
    checkpoint: Path | None = None
    """The last checkpoint written."""
    preempted: bool = False
    """Stopped by SIGTERM/SIGINT: a checkpoint was saved and `--resume` continues the run."""
    best: tuple[Path, int, str, float] | None = None
    """With `checkpoint.keep_best`: the best model's directory, step, ranking metric and its value."""
    final_is_best: bool = False
    """`final/` holds the best model (`checkpoint.best_at_end`), or the last weights were the best."""


def train(recipe: Recipe | str | Path, overrides: list[str] | tuple[str, ...] = (), resume: str | None = None,
          force: bool = False) -> TrainResult:
    """Train the model a recipe describes; returns where it went and how it did. Works under `accelerate launch`.

    resume: `"latest"` continues from the newest verified checkpoint of the run directory (or starts fresh when there
        is none), a path continues from that checkpoint. The continuation is exact: the same batches, RNG states and
        counters as a run that never stopped. None: the recipe's `train.resume` decides (`auto` means `"latest"`).
    force: resume even though training-relevant recipe fields differ from the checkpoint's recipe; they take effect.
    """
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, overrides)
    run_dir = recipe.run.dir
    quiet_libraries(recipe.log.progress_bar)
    # 0. Checks that need no compute: the task imported and built, the trackers' packages and arguments, the
    # checkpoint to resume from (verified by the main process, the same for all) and the recipe against it, the run
    # directory, callbacks.
    task = load_task(recipe)
    check_tracker_packages(recipe.log)
    check_tracker_kwargs(recipe.log)
    check_tracker_stores(recipe.log)
    processes = PartialState(cpu=CPU)  # the process group first, so that one process decides which checkpoint for all
    # One run per directory (no other overwrites or resumes it now), and what the run prints goes to its train.log.
    main = processes.is_main_process
    with RunLock(run_dir, main), RUN_LOG.capture(main, processes.process_index):
        return _train(recipe, task, resume, force)


def _train(recipe: Recipe, task, resume: str | None, force: bool) -> TrainResult:
    """`train`, once the run directory is this run's."""
    # 0. The checkpoint to resume from and the recipe against it, the Accelerator, the run directory checked.
    recipe, accelerator, run_files, resumed, layout = open_run(recipe, resume, force)
    set_seed(recipe.run.seed)
    callbacks = build_callbacks(recipe)

    # 1. Data, model, loaders, plan, optimizers (setup.py), all built before anything is written into the run
    # directory; then the run directory (an earlier run moved aside) and everything through accelerator.prepare.
    built = build_in_place(recipe, accelerator, run_files, task)
    context, total = built.context, built.plan.total_steps  # train.max_steps, or what train.max_epochs comes to
    model, optimizers, train_dl, val_dls = prepare(accelerator, task, built, layout)
    context.optimizers = {o.name: o for o in optimizers}
    del built  # the unprepared objects: the prepared ones above replace them

    # 2. The checkpointed state, restored when resuming; what callbacks see of the run.
    state = restore(accelerator, resumed, recipe, optimizers, [*task.stateful(), *callbacks.stateful()])
    signals = StopSignals()
    run = run_context(accelerator, recipe, task, model, optimizers, state, context.data.tokenizer, val_dls, signals)
    with signals, frozen_setup_objects():  # from the trackers on, a SIGTERM is a request the next step answers
        callbacks.on_train_start(run)
        start_logging(accelerator, recipe, state, task, model, context.data, train_dl, layout)
        run_files.drop_replaced()  # the new run has started: the outputs it replaces go

        # 3. The loop: one iteration per optimizer step.
        step = Stepper(accelerator, model, task, optimizers, recipe, signals, layout, state)
        batches = batch_stream(accelerator, train_dl, state, partial(callbacks.on_epoch_start, run),
                               partial(callbacks.on_epoch_end, run))
        meter, bar = Meter(accelerator, state, recipe, model), progress_bar(accelerator, recipe, total, state.step)
        eval_due = evaluation_schedule(recipe.train.eval_every, context.plan, state)  # every N steps, or each epoch
        eval_metrics = eval_at_start(run, callbacks, bar)  # train.eval_at_start, or one a stop cut short
        last_ckpt, stop_reason, preempted = resumed.checkpoint, None, False
        t_start = time.perf_counter()
        while state.step < total and stop_reason is None:
            # a. The micro-batch window, clipping, the agreement of every process, the update (step.py).
            out = step(batches, state, stop_requested=run.stop_reason is not None)
            if out.skipped:  # non-finite numbers: the update was dropped (or the run stopped, by policy)
                continue
            flags = out.flags
            if not out.aborted:  # b. A step was taken: count it, log, evaluate.
                meter.add(**out.scalars)
                bar.update(1)
                callbacks.on_step_end(run)
                if due(state.step, recipe.log.log_every, total):
                    meter.log(run, callbacks, optimizers, bar)  # the loop's only host sync besides the agreement
                if eval_due() or flags.out_of_time:  # due, or the run's last step: train.max_time is spent
                    eval_metrics = evaluate_and_report(run, callbacks, bar) or eval_metrics
                    task.on_validation_end()
                    flags = flags.merge(agree(accelerator, None, signal=signals.interrupted(),
                                              stop=run.stop_reason is not None))
            # c. Stop when any process asks (a signal, a callback) or the time is spent: the same step on every one.
            preempted, stop_reason = stop_decision(flags, signals, run, total)
            # d. Save: every `every_steps`, when due by time, and before stopping (an aborted window: its last step).
            if due(state.step, recipe.checkpoint.every_steps) or flags.save or stop_reason:
                last_ckpt = save_checked(accelerator, model, run.run_dir, state.step, recipe)
                callbacks.on_save(run, last_ckpt)
                step.clock.reset()
        if resumed.checkpoint and state.step == total and not (eval_metrics or preempted):  # resumed at the end:
            eval_metrics = evaluate_and_report(run, callbacks, bar) or eval_metrics  # the evaluation a stop cut short
    batches.close()  # ends a pass the last step completed (its on_epoch_end), as the next batch would have
    bar.close()
    result = TrainResult(run_dir=run.run_dir, final_dir=None, steps=state.step, eval_metrics=eval_metrics,
                         loop_seconds=time.perf_counter() - t_start, throughput=meter.summary(), preempted=preempted,
                         is_main_process=accelerator.is_main_process, stop_reason=stop_reason, checkpoint=last_ckpt)

    # 4. Export (config + safetensors + generation config + tokenizer, loadable by from_pretrained), unless the
    # cluster wants the machine back (preempted: the checkpoint is written, leave now).
    if not preempted:
        result.final_dir, result.samples, result.best, result.final_is_best = export_final(run, callbacks)
    # 5. Every process leaves together: the wrapped model (its DDP reducer holds the process group) is freed while
    # all are still here, then the group is destroyed. Freed after one process had exited, it waited forever for it.
    del model, run, step, batches
    context.optimizers = {}
    finish(accelerator)
    return result


@dataclass(frozen=True)
class Resuming:
    """What a run continues from: the checkpoint (None for a fresh run), the training-relevant fields `--force`
    changed, and the world the checkpoint was saved by when it is not this one (`world.py`)."""

    checkpoint: Path | None = None
    changed: list[str] = field(default_factory=list)
    saved_world: World | None = None


def open_run(recipe: Recipe, resume: str | None, force: bool):
    """The checkpoint to resume from (the main process verifies it, the same for all) and the recipe checked against
    it (on another number of processes too); the Accelerator set for it; the processes' layout
    (`train.context_parallel`); the run directory checked (refused when it holds another run). Returns the recipe to
    run (`--force` may recompute `train.grad_accum` to keep the checkpoint's global batch on another number of
    processes), the Accelerator, the `RunDir`, the `Resuming` and the `Layout`."""
    resume, asked_by = requested_resume(recipe, resume)
    recipe = with_version(recipe, resuming=resume is not None)
    ckpt, notes = choose_checkpoint(recipe.run.dir, resume)
    resuming = Resuming()
    if ckpt is not None:
        recipe, saved_world = plan_world_change(ckpt, recipe, PartialState().num_processes, force)
        changed = check_resumed_recipe(ckpt, recipe, force, batching_may_change=saved_world is not None)
        check_time_left(ckpt, recipe)
        resuming = Resuming(ckpt, changed, saved_world)
    accelerator = make_accelerator(recipe, ckpt)
    layout = context_parallel.start(recipe, accelerator)  # which chunk of each sequence this process reads
    run_files = RunDir(recipe.run.dir, accelerator.is_main_process, resuming=ckpt is not None,
                       resume_requested=asked_by, overwrite=recipe.run.overwrite)
    warn(accelerator, *notes, run_files.check(), *setup_warnings(accelerator))
    return recipe, accelerator, run_files, resuming, layout


def build_in_place(recipe: Recipe, accelerator, run_files: RunDir, task: Task):
    """`build_run` while nothing is written into the run directory yet, then the directory itself (an earlier run
    moved aside); a warmup longer than the run, cut to it, said once."""
    with run_files.building():
        built = build_run(recipe, accelerator, run_files.build_dir, task=task)
    run_files.commit(recipe.to_yaml())
    warn(accelerator, built.plan.warmup_note)
    return built


def requested_resume(recipe: Recipe, resume: str | None) -> tuple[str | None, str | None]:
    """What to resume from and who asked for it: the command line's `--resume` (the API's `resume`) wins over the
    recipe's `train.resume: auto`, which means `--resume` alone. (None, None): a fresh run."""
    if resume is not None:
        return resume, "--resume"
    if recipe.train.resume == "auto":
        return "latest", "train.resume: auto"
    return None, None


def run_context(accelerator, recipe: Recipe, task: Task, model, optimizers: list[TrainOptimizer], state: TrainState,
                tokenizer, val_dls: dict, signals: StopSignals) -> RunContext:
    """What callbacks (and the loop's logging) see of the run; `evaluate(model)` runs the validation split and the
    more evaluation sets (`val_dls`, by name; cut short by a stop signal)."""
    evaluates = partial(evaluate, accelerator, task, loaders=val_dls, abort=signals.interrupted,
                        progress=recipe.log.progress_bar)
    return RunContext(accelerator=accelerator, model=model, optimizer=optimizers[0].optimizer,
                      scheduler=optimizers[0].scheduler, state=state, recipe=recipe, run_dir=recipe.run.dir,
                      tokenizer=tokenizer, evaluate=evaluates, export=task.export, task=task, optimizers=optimizers)


def progress_bar(accelerator, recipe: Recipe, total: int, initial: int) -> tqdm:
    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True,
                disable=not (accelerator.is_main_process and recipe.log.progress_bar))


def restore(accelerator, resuming: Resuming, recipe: Recipe, optimizers: list[TrainOptimizer],
            stateful: list) -> TrainState:
    """What a checkpoint holds, in registration order (the checkpoint format): schedules, loop counters, the task's
    own state (stateful training's carried state), stateful callbacks. Loaded when resuming; from a checkpoint of
    another number of processes, the position in the epoch and the random streams are this world's (`world.py`)."""
    state = TrainState(recipe_hash=recipe_hash(recipe))
    saved = [*(o.scheduler for o in optimizers), state, *stateful]
    accelerator.register_for_checkpointing(*saved)
    old = resuming.saved_world
    if resuming.checkpoint is not None:
        resume_from(accelerator, resuming.checkpoint, saved, optimizers, resuming.changed, other_world=old is not None)
    if old is not None:
        here = World(accelerator.num_processes, recipe.data.batch_size, recipe.train.grad_accum)
        move_to_world(state, old, here, recipe.run.seed, accelerator.process_index)
        accelerator.print(f"resumed on {here.processes} process(es) from a checkpoint of {old.processes}: "
                          f"{here.describe()} (as saved: {old.global_batch}); random streams derived again from "
                          f"run.seed, the step and the process")
    return state


def export_final(run: RunContext, callbacks: CallbackList):
    """`final/` from the trained model; the samples the language model writes; then what callbacks add (final_ema/
    and the like, before a push reads them); the best model kept and whether final/ is it (`best_model`)."""
    final = run.run_dir / "final"
    context_parallel.read_whole(run.accelerator, run.model)  # whole sequences again: the samples' generate()
    run.task.export(run.model, final)
    run.task.on_train_end(run.model)
    samples = getattr(run.task, "samples", [])
    callbacks.on_train_end(run)
    return final, samples, *best_model(run, run.recipe.checkpoint)


def warn(accelerator, *notes: str | None) -> None:
    for note in notes:
        if note:
            accelerator.print(f"warning: {note}")


def stop_decision(flags, signals: StopSignals, run: RunContext, total: int) -> tuple[bool, str | None]:
    """(preempted, why) when the agreed flags stop the run after this step, (False, None) to go on. Out of time, the
    run ends as at max_steps (final/ is written), its counters at least at the limit whatever this process's clock
    said, so that the checkpoint (which holds the main process's) records the budget as spent."""
    if flags.signal:
        return True, f"received {signals.received or 'a stop signal on another process'}"
    if flags.stop:
        return False, run.stop_reason or "a callback on another process asked to stop"
    limit = run.recipe.train.max_time_s
    if flags.out_of_time and run.state.step < total:
        run.state.train_seconds = max(run.state.train_seconds, limit)
        return False, f"train.max_time {spoken(limit)} reached"
    return False, None


def due(step: int, every: int, last: int | None = None) -> bool:
    """Every `every` steps (never when 0), and at step `last`."""
    return bool(every and step % every == 0) or step == last


def setup_warnings(accelerator) -> list[str]:
    """What the launch asked for that does not happen here."""
    out = []
    for kind in ("FSDP", "DEEPSPEED"):  # Accelerate 1.15 selects them only on GPUs; on CPU processes it runs DDP
        if os.environ.get(f"ACCELERATE_USE_{kind}", "").lower() == "true" and accelerator.distributed_type != kind:
            out.append(f"the accelerate config asks for {kind}, but Accelerate runs "
                       f"{accelerator.distributed_type.value} here (it uses {kind} only on GPUs)")
    asked = launch_asked_for()
    if asked is not None and asked > accelerator.num_processes:
        out.append(f"accelerate launch was asked for {asked} processes (--num_processes {asked}) but this run has "
                   f"{accelerator.num_processes}: without a config file it starts one process where there is no GPU; "
                   f"use --config_file accelerate_configs/cpu_2proc.yaml for CPU processes")
    on_machine = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if accelerator.device.type == "cpu" and on_machine > cores:
        # A GPU launch config on a machine without GPUs starts its processes on the CPU, where they share the cores:
        # every step is many times slower than with one process per core.
        out.append(f"{on_machine} processes on {cores} CPU cores and no GPU (a GPU launch config on this machine?): "
                   f"expect every step to be many times slower; use --num_processes {cores} or "
                   f"accelerate_configs/cpu_2proc.yaml")
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        warnings.warn("fp16 mixed precision has no effect on CPU (Accelerate runs float32 there, without a "
                      "GradScaler); use train.mixed_precision=bf16 for half precision on CPU", stacklevel=3)
    return out


def start_logging(accelerator, recipe: Recipe, state: TrainState, task: Task, model, data, train_dl,
                  layout: context_parallel.Layout) -> None:
    """Trackers started with the flattened recipe; one line saying what trains on what."""
    accelerator.init_trackers(recipe.run.name, config={**tracker_config(recipe.to_dict()), "run_id": state.run_id})
    streamed = not hasattr(data.train, "__len__")
    n_train = "streamed" if streamed and data.n_train is None else f"{data.n_train or len(data.train):,}"
    n_val = data.n_val if data.n_val is not None else len(data.val)
    accelerator.print(f"{recipe.run.name} ({type(task).__name__}): {count_params(model):,} parameters, {n_train} "
                      f"train / {n_val:,} val {data.unit}{eval_sets_note(data)}, {processes_line(accelerator)}, "
                      f"mixed precision {precision(accelerator)}")
    rows = recipe.data.batch_size if recipe.train.compile else None  # (segments: compiled steps only)
    if line := convolution_line(accelerator.unwrap_model(model), accelerator, rows):
        accelerator.print(line)
    if line := layout.describe(accelerator, model, recipe):
        accelerator.print(line)
    if line := graphs.start_line(recipe, accelerator):
        accelerator.print(line)
    batches = None if streamed else len(train_dl)
    if batches is not None and recipe.train.grad_accum > batches:
        warnings.warn(f"train.grad_accum={recipe.train.grad_accum} micro-batches are more than the {batches} batches "
                      f"of an epoch (per process): each optimizer step spans more than one epoch", stacklevel=3)


@contextlib.contextmanager
def frozen_setup_objects():
    """The ~10^5 long-lived objects of setup (dataset, tokenizer, modules, recipe) go to the permanent generation for
    the loop: otherwise each full collection the loop's garbage triggers rescans them all (0.2 s here, a 13% slower
    loop). Handed back to the collector when the loop ends, however it ends."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def build_callbacks(recipe: Recipe) -> CallbackList:
    """Built-ins first, in a fixed order (EMA adds its metrics before the others read them), then the recipe's."""
    ema = EMA(**recipe.train.ema.model_dump()) if recipe.train.ema is not None else None
    cbs = [ema] if ema else []
    if recipe.train.early_stopping is not None:
        cbs.append(EarlyStopping(**recipe.train.early_stopping.model_dump()))
    ck = recipe.checkpoint
    if ck.keep_best:
        cbs.append(KeepBest(ck.keep_best, ck.best_metric, ck.best_mode, ema=ema))
    if recipe.train.profile is not None:
        cbs.append(Profile(**recipe.train.profile.model_dump()))
    cbs += [load_callback(c.target, c.args, f"callbacks.{i}") for i, c in enumerate(recipe.callbacks)]
    return CallbackList(cbs)


def prepare(accelerator, task: Task, built, layout: context_parallel.Layout):
    """Everything through `accelerator.prepare` in one call (DeepSpeed and FSDP need model and optimizers together),
    except: a stream loader of stateful training (fixed rows per process in text order; a sharded loader would
    interleave them, so a carried state would continue another row's text), under manual optimisation the DDP
    wrapper (`Task.step` averages gradients itself), and under context parallelism the training loader, dealt per
    data-parallel group after the rest, and the model then told which chunk of each sequence it reads."""
    model, optimizers, (train_dl, _, shard_train) = built.model, built.optimizers, built.loaders
    split = layout.mesh is not None and shard_train
    evals = built.evaluation_loaders()  # the validation split's, then the more evaluation sets' by name
    objs = [*(o.optimizer for o in optimizers), *([train_dl] if shard_train and not split else []), *evals.values()]
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
    if split:
        with layout.dealing(accelerator):
            train_dl = accelerator.prepare(train_dl)
    elif shard_train:
        train_dl = objs.pop(0)
    layout.attach(accelerator, model)
    return model, optimizers, train_dl, dict(zip(evals, objs))


def count_params(model) -> int:
    """All parameters, whole: DeepSpeed ZeRO-3 leaves each process an empty tensor and its size (`ds_numel`)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
