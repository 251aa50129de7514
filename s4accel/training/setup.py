"""Building a run: the one place that turns a recipe into a task with its data, model, optimizers, loaders and
length. `train`, `eval`, `lr-find`, `find-batch-size` and `show` all start here, so a feature of the setup (a precision
policy, document boundaries, another world size) is added once and every command gets it.

    task, context = setup_task(recipe, accelerator, build_dir)      # show: the task, handed its context once
    run = build_run(recipe, accelerator, build_dir)                 # everything else: a frozen Run
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin, TorchDynamoPlugin, broadcast_object_list
from torch.utils.data import Subset

from ..config import Recipe
from ..errors import RecipeError, S4AccelError
from .runs.checkpoint import checkpoint_step
from .devices.graphs import wants_graphs
from .lora import check_runtime
from .optim import check_optimizer
from .plan import Plan, make_plan
from .devices.precision import apply_fsdp_precision, convolution_line
from .pretrained import freeze
from .task import Loaders, Task, TaskContext, TaskData, TrainOptimizer, as_loaders, load_task
from .observe.tracking import build_trackers
from .devices.fits import check_fits, shards
from .devices.compiled_loss import compile_loss
from .devices.zero import configure_deepspeed, model_build

CPU = not torch.accelerator.is_available()
"""No accelerator: processes started by `accelerate launch --multi_gpu` (torchrun) must be told they are CPU
processes, or each runs alone; with cpu=True they form a gloo group (DistributedType.MULTI_CPU)."""


def make_accelerator(recipe: Recipe, ckpt: Path | None = None, trackers: bool = True) -> Accelerator:
    """The Accelerator every command builds from a recipe: its precision, accumulation and seeded sampler, compiled
    when asked; the recipe's trackers only for a training run (`trackers`), resumed at `ckpt`'s step."""
    cfg = recipe.train
    if cfg.tf32 and torch.cuda.is_available():  # before any CUDA work; Ampere and newer
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    log_with = (build_trackers(recipe.log.log_with, recipe.run.name, recipe.run.dir,
                               resume_step=checkpoint_step(ckpt) if ckpt else None,
                               kwargs=recipe.log.tracker_kwargs, retries=recipe.log.tracker_retries,
                               backoff_s=recipe.log.tracker_backoff_s, project=recipe.log.project,
                               timeout_s=recipe.log.tracker_timeout_s) if trackers else None) or None
    try:
        accelerator = accelerator_for(cfg, log_with, recipe.run.dir)
    except ValueError as e:  # Accelerate refusing its config (a DeepSpeed or FSDP section), checked as it is read
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        raise RecipeError(f"the accelerate config: {' '.join(lines[:2])[:500]}") from None
    configure_deepspeed(accelerator, recipe)  # under DeepSpeed the engine steps: it takes the recipe's step settings
    ask_lomo_once()
    return accelerator


def accelerator_for(cfg, log_with, project_dir) -> Accelerator:
    """The Accelerator of a run's `train` settings, its trackers and the launcher's config."""
    return Accelerator(
        cpu=CPU,
        mixed_precision=cfg.mixed_precision,  # None: from the accelerate config / launch flags
        # We hand accumulate() exactly grad_accum micro-batches per optimizer step, across epoch boundaries too.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False),
        # Resuming mid-epoch replays exactly the batches of an uninterrupted run only with the seedable sampler (with
        # `set_epoch` every epoch and `skip_first_batches` in the resumed one): any other setup reshuffles.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        log_with=log_with,
        project_dir=str(project_dir),
        step_scheduler_with_optimizer=False,
        # torch.compile in prepare(), after DDP wrapping; each distinct repeated block compiled once (regional),
        # or the whole model where CUDA graphs capture it (graphs.py: one graph for the embedding, blocks and head).
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode=cfg.compile_mode,
                                        use_regional_compilation=not wants_graphs(cfg))
        if cfg.compile else None,  # None: from the accelerate config / launch flags
    )


def ask_lomo_once() -> None:
    """Accelerate's optimizer step asks `is_lomo_available()` twice per step (accelerate 1.10 to 1.15), and each time
    it searches the import system (`importlib.util.find_spec`): 0.37 ms a step on our CPUs, a tenth of the tiny
    model's whole step and most of what s4accel's loop cost over plain Accelerate's. Whether `lomo_optim` is
    installed does not change during a run, so the answer is kept after the first question: the same function,
    cached, in the one module that asks it per step."""
    import functools

    import accelerate.optimizer

    check = getattr(accelerate.optimizer, "is_lomo_available", None)
    if check is not None and not hasattr(check, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(check)


@dataclass(frozen=True)
class Run:
    """A run as built, before `accelerator.prepare`: each piece made once, in the order below."""

    task: Task
    context: TaskContext
    """What the task was handed (the accelerator, its folders, its data, the plan)."""
    model: torch.nn.Module
    optimizers: list[TrainOptimizer]
    """Empty when built for evaluation alone."""
    loaders: Loaders
    plan: Plan
    eval_loaders: dict = field(default_factory=dict)
    """A loader for each of the task's more evaluation sets (`TaskData.eval_sets`), by name."""

    def evaluation_loaders(self) -> dict:
        """What an evaluation reads, by name: `""` the validation split, then each more evaluation set."""
        return {"": self.loaders.val, **self.eval_loaders}


def setup_task(recipe: Recipe, accelerator, build_dir: Path | None, task: Task | None = None
               ) -> tuple[Task, TaskContext]:
    """The recipe's task (imported and checked, unless given), set up with its context."""
    task = task if task is not None else load_task(recipe)
    context = TaskContext(accelerator, recipe.run.dir, build_dir)
    task.setup(context)
    return task, context


def build_run(recipe: Recipe, accelerator, build_dir: Path | None, *, task: Task | None = None,
              model: Callable[[Task], torch.nn.Module] | None = None, optimizers: bool = True) -> Run:
    """Task, data (the main process first: it tokenises, or trains a BPE, and the others read its cache), model
    (`model(task)` instead of the task's own: a trained one loaded for evaluation), the recipe's freezing and
    activation checkpointing, FSDP's float32 units (precision.py), loaders, the plan (before the schedules:
    `train.max_epochs` counts batches), then the optimizers with their schedules (unless `optimizers=False`)."""
    task, context = setup_task(recipe, accelerator, build_dir, task)
    check_runtime(accelerator, recipe)
    if optimizers:  # the recipe's optimizer and its arguments, before the data is tokenised
        check_optimizer(recipe.optim, accelerator.device.type, accelerator.distributed_type.value)
    context.data = fewer_train_examples(main_first(accelerator, task.build_data), recipe.data.max_train_examples,
                                        recipe.run.seed)
    if model is None:
        if recipe.task.builtin:  # sized from its config before anything is allocated
            from ..data import data_spec
            from .tasks_builtin import build_model as builtin_model

            with model_build(accelerator, whole=True):
                check_fits(recipe, data_spec(recipe.data, getattr(task, "data", None)), accelerator.device,
                           lambda r, spec: builtin_model(r, None, device="meta", spec=spec),
                           shards(accelerator))
        with model_build(accelerator):
            net = build_model(task, recipe)
        convolution_line(net, accelerator)  # an S4 path forced where it cannot run: refused now, one line
        if recipe.model.freeze:  # fixed parameters, out of the optimizer built next
            frozen = freeze(net, recipe.model.freeze)
            accelerator.print(f"model.freeze: {len(frozen)} parameter tensor(s) fixed")
        if recipe.train.activation_checkpointing:
            enable_activation_checkpointing(net)
    else:
        net = model(task)
    compile_loss(net, accelerator)  # regional compilation leaves the model's own loss eager: compiled with the blocks
    if units := apply_fsdp_precision(accelerator, net):
        kinds = ", ".join(sorted({u.rsplit(".", 1)[-1] for u in units}))
        accelerator.print(f"FSDP mixed precision: {len(units)} float32 units ({kinds}), "
                          f"{accelerator.mixed_precision} for the rest, gradients reduced in float32")
    loaders = as_loaders(task.dataloaders(context.data), task)
    # under context parallelism the processes of a group draw the same batches: one share per data-parallel group
    dealt_to = accelerator.num_processes // recipe.train.context_parallel
    context.plan = make_plan(recipe, loaders.train, dealt_to, loaders.shard_train)
    built = check_optimizers(task.build_optimizers(net), task) if optimizers else []
    return Run(task, context, net, built, loaders, context.plan, task.eval_loaders(context.data))


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
                          f"s4accel.TrainOptimizer with distinct names")
    return optimizers


def fewer_train_examples(data: TaskData, keep: int | None, seed: int) -> TaskData:
    """`data.max_train_examples`: a seeded random subset of the training set (in its own order), its size in units
    scaled to match; the data as it is without a limit or when it holds no more."""
    if keep is None or not hasattr(data.train, "__len__") or len(data.train) <= keep:
        return data
    n = len(data.train)
    picked = sorted(np.random.default_rng(seed).permutation(n)[:keep].tolist())
    train = data.train.select(picked) if hasattr(data.train, "select") else Subset(data.train, picked)
    units = None if data.n_train is None else round(data.n_train * keep / n)
    return replace(data, train=train, n_train=units)


def main_first(accelerator, build: Callable[[], object]):
    """`build()` on the main process first (it fills the caches the others then read), then on the others; a user
    error the main process meets (data too short, a file it cannot read) is raised on every process, so all stop at
    the same line. With `main_process_first` the others were left waiting at its barrier for a process that had
    gone, and died with a gloo traceback."""
    error, result = None, None
    if accelerator.is_main_process:
        try:
            result = build()
        except S4AccelError as e:
            error = e
    box = [error]
    broadcast_object_list(box)  # from the main process
    if box[0] is not None:
        raise box[0]
    if not accelerator.is_main_process:
        result = build()
    return result

