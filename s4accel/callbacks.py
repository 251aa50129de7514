"""Callbacks: a small set of hooks the loop calls on every process, and the built-ins that use them.

A recipe attaches its own by import path, after the built-ins:

    callbacks:
      - {target: mypkg.hooks:PrintLoss, args: {every: 100}}

A callback that has `state_dict`/`load_state_dict` is saved in every checkpoint and restored on resume (the order
of the recipe's list is part of the checkpoint format, as for everything `register_for_checkpointing` saves).
Hooks run on every process: a callback that writes files checks `run.accelerator.is_main_process`. To end training,
call `run.request_stop(reason)`: the loop agrees on it across processes, saves a checkpoint and finishes normally.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import RecipeError


class Callback:
    """Base class: override the hooks you need. `run` is the `RunContext` of the training run."""

    def on_train_start(self, run: RunContext) -> None: ...

    def on_step_end(self, run: RunContext) -> None:
        """After each optimizer step (`run.state.step` counts them), before logging, evaluation and saving."""

    def on_log(self, run: RunContext, logs: dict) -> None:
        """After the loop logged training scalars (every `log.log_every` steps)."""

    def on_eval_end(self, run: RunContext, metrics: dict) -> None:
        """After an evaluation; `metrics` are gathered over all processes (loss, ppl, bits_per_byte, bits_per_char)."""

    def on_save(self, run: RunContext, checkpoint_dir: Path) -> None:
        """After a complete checkpoint was written."""

    def on_train_end(self, run: RunContext) -> None:
        """After the final model was exported (not called when training fails)."""


@dataclass
class RunContext:
    """What callbacks see of a run. `evaluate(model)` returns gathered validation metrics of any model copy (e.g. an
    EMA); `log(values)` logs at the current step; `export(model, dir, extra_files=None)` atomically writes a
    `from_pretrained` directory (with the tokenizer and any extra `{name: text}` files); call it on every process."""

    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    state: Any
    recipe: Any
    run_dir: Path
    tokenizer: Any
    evaluate: Callable[[Any], dict | None]
    export: Callable[..., None]
    stop_reason: str | None = None
    task: Any = None
    """The run's `s4accel.tasks.Task`."""
    optimizers: list = field(default_factory=list)
    """Every `TrainOptimizer` (name, optimizer, scheduler); `optimizer`/`scheduler` are the first one's."""

    def log(self, values: dict) -> None:
        self.accelerator.log(values, step=self.state.step)

    def request_stop(self, reason: str) -> None:
        """Ask the loop to save a checkpoint and end training after this step."""
        self.stop_reason = self.stop_reason or reason


@dataclass
class CallbackList:
    """Calls a hook on every callback, in order."""

    callbacks: list[Callback] = field(default_factory=list)

    def __getattr__(self, hook: str):
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args, **kwargs):
            for cb in self.callbacks:
                getattr(cb, hook)(*args, **kwargs)

        return call

    def stateful(self) -> list[Callback]:
        return [cb for cb in self.callbacks if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")]


def load_callback(target: str, args: dict, where: str) -> Callback:
    """`package.module:Class` + keyword arguments -> an instance; import and argument errors name the recipe key."""
    module_name, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise RecipeError(f"{where}.target: cannot import {target!r} ({e})") from None
    try:
        cb = obj(**args)
    except TypeError as e:
        raise RecipeError(f"{where}.args: {target} does not take these arguments ({e})") from None
    if not all(callable(getattr(cb, hook, None)) for hook in HOOKS):
        raise RecipeError(f"{where}.target: {target} is not a callback (subclass s4accel.callbacks.Callback)")
    return cb


HOOKS = [name for name in vars(Callback) if name.startswith("on_")]


# --------------------------------------------------------------------------------------------------------------------
# Built-ins


def improved(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


class EarlyStopping(Callback):
    """Stop when the monitored eval metric has not improved by `min_delta` for `patience` evaluations, or at once when
    it is non-finite or worse than `divergence_threshold`. Every process sees the same gathered metrics, so every
    process decides the same; the loop still agrees on the stop collectively."""

    def __init__(self, metric: str = "loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 divergence_threshold: float | None = None):
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.divergence_threshold = divergence_threshold
        self.best: float | None = None
        self.bad_evals = 0

    def on_eval_end(self, run, metrics):
        value = metrics[self.metric]
        diverged = not math.isfinite(value) or (self.divergence_threshold is not None and (
            value > self.divergence_threshold if self.mode == "min" else value < self.divergence_threshold))
        if diverged:
            run.request_stop(f"early stopping: eval {self.metric} {value:.4g} diverged "
                             f"(threshold {self.divergence_threshold})")
            return
        if improved(value, self.best, self.mode, self.min_delta):
            self.best, self.bad_evals = value, 0
            return
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            run.request_stop(f"early stopping: eval {self.metric} has not improved on {self.best:.4g} for "
                             f"{self.bad_evals} evaluations")

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad_evals = state["best"], state["bad_evals"]


class EMA(Callback):
    """Exponential moving average of the weights (`torch.optim.swa_utils.AveragedModel`): updated every `every`
    optimizer steps from `start_step` on, evaluated beside the raw weights (`ema_*` metrics, logged as
    `eval_ema/*`), saved in every checkpoint, and exported to `<run_dir>/final_ema` as its own `from_pretrained`
    directory."""

    def __init__(self, decay: float = 0.999, start_step: int = 0, every: int = 1):
        self.decay, self.start_step, self.every = decay, start_step, every
        self.averaged = None  # the model copy exists from on_train_start on
        self._loaded: dict | None = None  # a checkpoint's EMA state, loaded before the copy existed

    def on_train_start(self, run):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.averaged = AveragedModel(run.accelerator.unwrap_model(run.model),
                                      multi_avg_fn=get_ema_multi_avg_fn(self.decay))
        self.averaged.requires_grad_(False)
        if self._loaded is not None:
            self.averaged.load_state_dict(self._loaded)

    def on_step_end(self, run):
        step = run.state.step
        if step >= self.start_step and (step - self.start_step) % self.every == 0:
            self.averaged.update_parameters(run.accelerator.unwrap_model(run.model))

    def on_eval_end(self, run, metrics):
        if int(self.averaged.n_averaged) == 0:
            return  # nothing averaged yet (before start_step)
        ema_metrics = run.evaluate(self.averaged.module)
        if ema_metrics is not None:  # logged with the raw metrics, as eval_ema/*
            metrics.update({f"ema_{k}": v for k, v in ema_metrics.items()})

    def on_train_end(self, run):
        if int(self.averaged.n_averaged) > 0:
            run.export(self.averaged.module, run.run_dir / "final_ema")

    def state_dict(self) -> dict:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._loaded = state
        if self.averaged is not None:
            self.averaged.load_state_dict(state)


class KeepBest(Callback):
    """Keep the `keep` best models by an eval metric as `from_pretrained` directories
    `<run_dir>/best/step_XXXXXXXX`, each with a `metrics.json` (the EMA weights when ranked by an `ema_*` metric).
    The ranking is read back from disk, so it survives crashes and resumes."""

    def __init__(self, keep: int, metric: str = "loss", mode: str = "min", ema: EMA | None = None):
        self.keep, self.metric, self.mode, self.ema = keep, metric, mode, ema

    def ranked(self, run_dir: Path) -> list[tuple[float, Path]]:
        """Best first (ties: the earlier step first)."""
        found = []
        for path in sorted((run_dir / "best").glob("step_*")):
            try:
                found.append((json.loads((path / "metrics.json").read_text())[self.metric], path))
            except (OSError, ValueError, KeyError):
                continue  # a directory a crash left half-written: it is replaced or rotated away
        return sorted(found, key=lambda vp: vp[0] if self.mode == "min" else -vp[0])

    def on_eval_end(self, run, metrics):
        value = metrics[self.metric]
        ranked = self.ranked(run.run_dir)
        if not math.isfinite(value) or (len(ranked) >= self.keep and not improved(value, ranked[self.keep - 1][0],
                                                                                  self.mode)):
            return
        target = run.run_dir / "best" / f"step_{run.state.step:08d}"
        # collective (every process calls it); metrics.json is written inside the atomic export
        model = self.ema.averaged.module if self.metric.startswith("ema_") else run.model
        run.export(model, target, {"metrics.json": json.dumps({"step": run.state.step, **metrics})})
        if run.accelerator.is_main_process:
            for _, old in self.ranked(run.run_dir)[self.keep:]:
                shutil.rmtree(old, ignore_errors=True)
        run.accelerator.wait_for_everyone()
