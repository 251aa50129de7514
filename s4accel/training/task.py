"""The Task API: what a run computes (data, model, optimizers, one training step, one validation batch), apart from
the loop that runs it (`loop.py`: devices, precision, accumulation, clipping, non-finite checks, logging, gathered
evaluation, checkpoints, export, callbacks). A task never imports the loop: the loop hands it a `TaskContext` once
(`setup`), before `build_data`, and fills in the built data and the prepared optimizers as it goes.

    from s4accel import Task, TaskData

    class MyTask(Task):
        def build_data(self):                      # map-style datasets (torch or `datasets`) and how to batch them
            return TaskData(train, val, collate_fn)
        def build_model(self):                     # any nn.Module; a PreTrainedModel exports with save_pretrained
            return MyModel()
        def training_step(self, model, batch, step):
            return loss                            # the mean over count_items(batch) (default: the batch's rows)
        def validation_step(self, model, batch):
            return {"sq_err": (pred - y) ** 2}     # per-sample values (B,); compute_metrics turns sums into metrics

A recipe picks a task with `task: {target: causal_lm | classification | package.module:Class | path/file.py:Class,
args: {...}}`; `args` go to the constructor. Without a target, text data trains `causal_lm` and array data
`classification`, the two built-in tasks (`tasks_builtin.py`).

Inside the methods, `self.recipe`, `self.accelerator`, `self.run_dir`, `self.build_dir` (where `build_data` may write
files), `self.optimizers` (by name, once prepared) and `self.tokenizer` are at hand.

Automatic optimisation (the default): the loop backpropagates the returned loss, weighted so that a window of
micro-batches (grad_accum, all processes) averages over all its items (not the mean of per-micro-batch means, which
weighs a short micro-batch's tokens more), clips, checks for NaN/inf on every process together, steps every optimizer
and its schedule.

Manual optimisation (`automatic_optimization = False`, e.g. a GAN's two optimizers taking turns): `training_step` calls
`self.backward(loss, "name")` and `self.step("name")` and returns the scalars to log. `backward` puts gradients into
that optimizer's parameters only, scaled for accumulation and fp16; `step` acts on a window's last micro-batch only:
it averages the gradients across processes, clips them, skips the update if they are not finite, then steps the
optimizer and its schedule. The model is not wrapped in DDP in this mode (several backward passes per step through one
DDP wrapper do not work); `step` does the averaging instead.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import default_collate

from ..data import build_dataloaders, eval_loader
from ..errors import RecipeError, did_you_mean
from .runs.checkpoint import export_pretrained
from .imports import import_object
from .optim import build_optimizers, build_scheduler
from .plan import Plan
from .observe.recipe_metrics import metric_functions


@dataclass
class TaskData:
    train: Any
    """Map-style training dataset: a `torch.utils.data.Dataset` or a `datasets.Dataset`."""
    val: Any
    """Map-style validation dataset (evaluated whole, gathered over processes)."""
    collate_fn: Callable | None = None
    """Examples -> a batch (a dict of tensors); None: torch's default collation."""
    tokenizer: Any = None
    """Saved with the model when set."""
    unit: str = "samples"
    """What `Task.count_units` counts, for the startup line (tokens, time steps, samples)."""
    n_train: int | None = None
    """Units in the training split (None: `len(train)`)."""
    n_val: int | None = None
    eval_sets: dict[str, Any] = field(default_factory=dict)
    """More evaluation sets by name, map-style like `val` (the built-in tasks: `data.eval_sets`): each is evaluated
    with `val`, its metrics reported as `<name>/<metric>`."""


@dataclass
class TrainOptimizer:
    """One optimizer, the schedule that steps with it, and its name (used by `Task.step` and in the logs)."""

    name: str
    optimizer: torch.optim.Optimizer
    scheduler: Any


class Loaders(NamedTuple):
    """What `Task.dataloaders` returns: the training and validation loaders, and whether `accelerator.prepare` may
    shard the training loader across processes (False: the task feeds each process its own share already)."""

    train: Any
    val: Any
    shard_train: bool = True


def as_loaders(result, task: Task) -> Loaders:
    """A task's `dataloaders` result as `Loaders`; a plain (train, val) pair is sharded as the task's class declares
    (`prepare_train_loader`)."""
    if isinstance(result, Loaders):
        return result
    train, val = result
    return Loaders(train, val, task.prepare_train_loader)


@dataclass
class WindowStats:
    """What a manual-optimisation task's `step` calls did in one accumulation window: each optimizer's gradient norm,
    the updates skipped for non-finite gradients, and those fp16's GradScaler skipped (overflow). The loop starts a
    new one per window and reads it after."""

    grad_norms: dict[str, torch.Tensor] = field(default_factory=dict)
    nonfinite_steps: int = 0
    scaler_skips: int = 0


@dataclass
class TaskContext:
    """What the loop hands a task once (`Task.setup`), before `build_data`. The loop owns it: it sets `data` when
    `build_data` has returned, `plan` when the loaders exist (before `build_optimizers`) and `optimizers` when they are
    prepared; the task only reads."""

    accelerator: Any
    run_dir: Path
    """The run directory: where `on_train_end` may write files of its own (plots, samples)."""
    build_dir: Path | None = None
    """Where `build_data` may write files (a trained tokenizer): a staging folder for a new run, moved into the run
    directory once every check has passed; the run directory itself when resuming."""
    data: TaskData | None = None
    plan: Any = None
    """The run's length (`training/plan.py`: batches per epoch, total and warmup steps), computed once."""
    optimizers: dict[str, TrainOptimizer] = field(default_factory=dict)
    window: WindowStats = field(default_factory=WindowStats)
    """Manual optimisation: the current window's `step` statistics (the loop's, replaced each window)."""


class Task:
    """Subclass and override `build_data`, `build_model`, `training_step`, `validation_step` (see the module docs)."""

    automatic_optimization: bool = True
    """False: `training_step` calls `self.backward` and `self.step` itself."""
    prepare_train_loader: bool = True
    """False: the loop does not shard the training loader across processes (the task feeds each process its own).
    A task whose choice depends on the recipe returns `Loaders(train, val, shard_train=...)` instead."""
    metric_names: tuple[str, ...] = ()
    """Names `compute_metrics` returns; when given, recipe keys naming a metric (checkpoint.best_metric,
    train.early_stopping.metric) are checked against them before training starts."""
    eval_set_names: tuple[str, ...] = ()
    """Names of the evaluation sets the task adds itself (`TaskData.eval_sets`) besides the recipe's
    `data.eval_sets`: recipe keys may name their metrics (`<name>/<metric>`)."""
    gathered: tuple[str, ...] = ()
    """`validation_step` values handed to `compute_metrics` whole instead of summed: every sample's, from all
    processes (each once), as one CPU tensor. What a sum cannot give needs them: F1, a confusion matrix, and the
    recipe's own `task.metrics`, which score `prediction` against `label`."""

    def __init__(self, recipe, **args):
        if args:
            raise TypeError(f"unexpected argument(s) {', '.join(args)}")
        self.recipe = recipe
        self.context: TaskContext | None = None  # handed over once by setup()

    def setup(self, context: TaskContext) -> None:
        """Called once, before `build_data`, by the loop (and by the tools that build a task's model)."""
        self.context = context

    @property
    def accelerator(self):
        return self.context.accelerator if self.context is not None else None

    @property
    def run_dir(self) -> Path | None:
        return self.context.run_dir if self.context is not None else None

    @property
    def build_dir(self) -> Path | None:
        return self.context.build_dir if self.context is not None else None

    @property
    def optimizers(self) -> dict[str, TrainOptimizer]:
        return self.context.optimizers if self.context is not None else {}

    @property
    def tokenizer(self):
        """The tokenizer of the data `build_data` returned, if any."""
        data = self.context.data if self.context is not None else None
        return data.tokenizer if data is not None else None

    # ---- what a task defines ----------------------------------------------------------------------------------------

    def build_data(self) -> TaskData:
        raise NotImplementedError(f"{type(self).__name__}.build_data")

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.build_model")

    def summary_model(self) -> torch.nn.Module:
        """The model `s4accel show` describes, on the meta device (shapes only, no memory). Default: `build_data`,
        then `build_model`; the built-in tasks size theirs from the recipe alone, without tokenising."""
        self.context.data = self.build_data()
        with torch.device("meta"):
            return self.build_model()

    def build_optimizers(self, model: torch.nn.Module) -> list[TrainOptimizer]:
        """Default: the recipe's optimizer (`optim.name`, AdamW unless it says otherwise) over the recipe's parameter
        groups (fused where the device has the kernel), with the recipe's schedule; `muon` is two, `muon` and
        `adamw`, each with that schedule."""
        device = self.accelerator.device.type if self.accelerator is not None else "cpu"
        return [TrainOptimizer(name, optimizer, self.schedule(optimizer))
                for name, optimizer in build_optimizers(model, self.recipe.optim, device)]

    def schedule(self, optimizer):
        """The recipe's schedule (`scheduler`, warmup, the run's length) for an optimizer of your own."""
        plan = self.context.plan if self.context is not None else None
        if plan is None:  # outside a run (a model described by `show`): the recipe's own length
            plan = Plan(None, self.recipe.total_steps, self.recipe.warmup_steps)
        return build_scheduler(optimizer, self.recipe.scheduler, plan.warmup_steps, plan.total_steps)

    def dataloaders(self, data: TaskData):
        """`Loaders(train, val, shard_train)` (a plain (train, val) pair is accepted too): shuffled full batches of
        `data.batch_size` with a seeded generator, and the validation split in order, cut to
        `train.eval_max_batches` per process."""

        r = self.recipe
        train, val = build_dataloaders(r.data, data, r.run.seed, r.train.eval_max_batches,
                                       self.accelerator.num_processes, collate=data.collate_fn or default_collate)
        return Loaders(train, val, self.prepare_train_loader)

    def eval_loaders(self, data: TaskData) -> dict:
        """A loader for each of `data.eval_sets`, by name, read as the validation split is."""
        r = self.recipe
        return {name: eval_loader(r.data, ds, r.train.eval_max_batches, self.accelerator.num_processes,
                                  data.collate_fn or default_collate, f"data.eval_sets.{name}")
                for name, ds in data.eval_sets.items()}

    def training_step(self, model, batch: dict, step: int):
        """Automatic: the loss (a 0-d tensor, mean over `count_items(batch)`), or a model output / dict with `loss`
        (and `aux_loss`, a term the loop averages over micro-batches instead of items). Manual: a dict of scalars."""
        raise NotImplementedError(f"{type(self).__name__}.training_step")

    def validation_step(self, model, batch: dict) -> dict[str, torch.Tensor]:
        """Per-sample values, each (B,) or (B, k); the loop sums each over the validation split on all processes
        (those named in `gathered` it hands over whole)."""
        raise NotImplementedError(f"{type(self).__name__}.validation_step")

    def compute_metrics(self, sums: dict[str, Any], count: int) -> dict[str, float]:
        """Metrics from the summed per-sample values (the `gathered` ones whole) and the number of samples. Default:
        each summed value's mean."""
        return {k: (v / max(count, 1) if isinstance(v, float) else [x / max(count, 1) for x in v])
                for k, v in sums.items() if k not in self.gathered}

    def count_items(self, batch: dict) -> torch.Tensor:
        """What `training_step`'s loss averages over (default: the batch's rows), to weigh ragged micro-batches."""
        return torch.tensor(_rows(batch), device=self.accelerator.device if self.accelerator else None)

    def count_units(self, batch: dict) -> int:
        """Units a batch holds, for the throughput log (`train/tokens_per_s`): rows by default."""
        return _rows(batch)

    def export(self, model, out_dir: Path, extra_files: dict[str, str] | None = None) -> None:
        """Write the model as a loadable directory (call on every process)."""
        export_pretrained(self.accelerator, model, self.tokenizer, out_dir, extra_files)

    def stateful(self) -> list:
        """Objects with `state_dict`/`load_state_dict` the checkpoints must carry besides model and optimizers."""
        return []

    def on_validation_end(self) -> None: ...

    def on_train_end(self, model) -> None:
        """After the final export, on every process."""

    # ---- helpers for manual optimisation ---------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, optimizer: str) -> None:
        """Backpropagate `loss` into the gradients of `optimizer`'s parameters only (others stay as they are), scaled
        by 1/grad_accum and by fp16's loss scale."""
        self._require_manual("backward")
        params = self._params(optimizer)
        self.accelerator.backward(loss, inputs=params)

    def step(self, optimizer: str) -> torch.Tensor | None:
        """On the window's last micro-batch: average `optimizer`'s gradients over processes, clip them
        (`train.clip_grad_norm`/`clip_grad_value`), then step it and its schedule, or skip the update when they are
        not finite; clear them. Returns the gradient norm before clipping (None on the other micro-batches)."""
        self._require_manual("step")
        acc, spec = self.accelerator, self._spec(optimizer)
        if not acc.sync_gradients:
            return None
        params = self._params(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        if acc.num_processes > 1 and grads:  # one all-reduce for the lot
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat = acc.reduce(flat, reduction="mean")
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        if acc.scaler is not None:  # this optimizer's gradients only: the other one may not be stepped yet
            acc.scaler.unscale_(spec.optimizer.optimizer)
        cfg = self.recipe.train
        if cfg.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, cfg.clip_grad_value)
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm or math.inf)
        window = self.context.window
        window.grad_norms[optimizer] = norm.detach()
        if torch.isfinite(norm):  # the same on every process: the gradients were averaged first
            spec.optimizer.step()
            if not acc.optimizer_step_was_skipped:
                spec.scheduler.step()
        elif acc.scaler is not None:  # fp16's overflow: the scaler lowers its scale (the gradients were unscaled
            acc.scaler.update()  # above: without an update the next unscale_ raises), and the update is skipped
            window.scaler_skips += 1
        else:
            window.nonfinite_steps += 1
        spec.optimizer.zero_grad(set_to_none=True)
        return norm

    def _spec(self, optimizer: str) -> TrainOptimizer:
        if optimizer not in self.optimizers:
            raise KeyError(f"no optimizer named {optimizer!r}; this task has {', '.join(self.optimizers)}")
        return self.optimizers[optimizer]

    def _params(self, optimizer: str) -> list[torch.nn.Parameter]:
        return [p for g in self._spec(optimizer).optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _require_manual(self, what: str) -> None:
        if self.automatic_optimization:
            raise RuntimeError(f"Task.{what} is for manual optimisation: set automatic_optimization = False")


def _rows(batch: dict) -> int:
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))


def count_items(batch) -> torch.Tensor:
    """What the built-in losses average over: real target tokens of a language-model batch (labels are shifted inside
    the model, so position 0 is never a target, unless `shift_labels` gives them shifted), or sequences of a
    classification batch (one label each)."""
    if "shift_labels" in batch:  # a chunk of a sequence split across processes: its targets are shifted already
        return (batch["shift_labels"] != -100).sum()
    labels = batch["labels"]
    if labels.dim() == 1:
        return torch.tensor(labels.shape[0], device=labels.device)
    return (labels[:, 1:] != -100).sum()


# --------------------------------------------------------------------------------------------------------------------
# Choosing a task


BUILTIN_TASKS = {"causal_lm": "s4accel.training.tasks_builtin:CausalLMTask",
                 "classification": "s4accel.training.tasks_builtin:SequenceClassificationTask"}
"""The built-in tasks by name, imported like a task of your own (the API does not depend on them)."""


def task_class(recipe) -> type[Task]:
    """The recipe's task class: a built-in by name, `package.module:Class`, or `path/to/file.py:Class`; without a
    target, chosen by the data (text -> causal_lm, arrays -> classification). Errors name `task.target`."""
    target = recipe.task.target or ("causal_lm" if recipe.data.is_lm else "classification")
    target = BUILTIN_TASKS.get(target, target)
    obj = import_object(target, "task.target")
    if not (inspect.isclass(obj) and issubclass(obj, Task)):
        raise RecipeError(f"task.target: {target} is not a task (subclass s4accel.Task)")
    return obj


def load_task(recipe, **extra) -> Task:
    """Import and construct the recipe's task with `task.args` (built before any compute: errors are recipe errors).
    Metric names the recipe uses are checked against the task's `metric_names`."""
    cls = task_class(recipe)
    try:
        task = cls(recipe, **recipe.task.args, **extra)
    except TypeError as e:
        raise RecipeError(f"task.args: {cls.__name__} does not take these arguments ({e})") from None
    check_metric_names(recipe, task, tuple(f.name for f in metric_functions(recipe, task)))
    if recipe.model.pretrained is not None and not type(task).__module__.startswith("s4accel."):
        raise RecipeError(f"model.pretrained: {cls.__name__} builds its own model; load pretrained weights in its "
                          f"build_model (s4accel.training.runs.safe_load.load_model reads them safely)")
    if recipe.model.lora is not None and not type(task).__module__.startswith("s4accel."):
        raise RecipeError(f"model.lora: {cls.__name__} builds its own model; put the adapters on it in its "
                          f"build_model (peft.get_peft_model)")
    return task


def check_metric_names(recipe, task: Task, own: tuple[str, ...] = ()) -> None:
    """The one place where the metrics a recipe names (`checkpoint.best_metric`, `train.early_stopping.metric`,
    `sweep.metric`) are checked: against what the task reports (`metric_names`, when it declares them) and the names
    of the recipe's own metric functions (`own`, for those that return a number), each also as `<set>/<metric>` of
    `data.eval_sets`, `ema_*` only with `train.ema`."""
    used = {"checkpoint.best_metric": recipe.checkpoint.best_metric} if recipe.checkpoint.keep_best else {}
    if recipe.train.early_stopping is not None:
        used["train.early_stopping.metric"] = recipe.train.early_stopping.metric
    if recipe.sweep is not None:
        used["sweep.metric"] = recipe.sweep.metric
    name = type(task).__name__
    names = [*task.metric_names, *own]
    sets = [*recipe.data.eval_sets, *task.eval_set_names]
    allowed = [*names, *(f"{s}/{m}" for s in sets for m in names)]
    allowed += [f"ema_{m}" for m in allowed]
    for key, metric in used.items():
        where, _, plain = metric.removeprefix("ema_").rpartition("/")
        if task.metric_names and where and where not in sets and plain in names:
            raise RecipeError(f"{key}: {metric!r} names an evaluation set {where!r} the run does not have; "
                              f"its sets are {', '.join(sets) or 'none'} (data.eval_sets)")
        if task.metric_names and metric not in allowed:
            raise RecipeError(f"{key}: {name} reports no metric {metric!r}{did_you_mean(metric, allowed)}; it "
                              f"reports {', '.join(names)}"
                              + (f" (and `<set>/<metric>` for data.eval_sets {', '.join(sets)})" if sets else ""))
        if metric.startswith("ema_") and recipe.train.ema is None:
            raise RecipeError(f"{key}: {metric!r} needs train.ema (the EMA weights are evaluated only then)")
