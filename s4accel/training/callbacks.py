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

import contextlib
import difflib
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..errors import RecipeError
from .imports import import_object


class Callback:
    """Base class: override the hooks you need. `run` is the `RunContext` of the training run."""

    def on_train_start(self, run: RunContext) -> None: ...

    def on_epoch_start(self, run: RunContext) -> None:
        """Before the first micro-batch of each pass over the training data (also of an epoch a resume continues).
        `run.state.epoch` counts the passes from 0."""

    def on_epoch_end(self, run: RunContext) -> None:
        """When the training data is used up, before the next pass starts, or with the run's last step when that
        step used it up (`train.max_epochs`); a run that ends mid-epoch does not end that epoch, and an endless
        stream has no epochs."""

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


@dataclass(kw_only=True)
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
    """The run's `s4accel.Task`."""
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
    """`package.module:Class` or `path/file.py:Class` + keyword arguments -> an instance; import and argument errors
    name the recipe key."""
    obj = import_object(target, f"{where}.target")
    try:
        cb = obj(**args)
    except TypeError as e:
        raise RecipeError(f"{where}.args: {target} does not take these arguments ({e})") from None
    if not all(callable(getattr(cb, hook, None)) for hook in HOOKS):
        raise RecipeError(f"{where}.target: {target} is not a callback (subclass s4accel.Callback)")
    # A method named like a hook but not one (Lightning's `on_train_epoch_end`, a typo) would never be called.
    for name in dir(cb):
        if name.startswith("on_") and name not in HOOKS and callable(getattr(cb, name)):
            lightning = name.replace("_train_epoch_", "_epoch_").replace("_validation_end", "_eval_end")
            close = [lightning] if lightning in HOOKS else difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise RecipeError(f"{where}.target: {target}.{name} is not a hook and would never be called ({hint}"
                              f"hooks: {', '.join(HOOKS)})")
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
    """Exponential moving average of the weights: updated every `every` optimizer steps from `start_step` on,
    evaluated beside the raw weights (`ema_*` metrics, logged as `eval_ema/*`), saved in every checkpoint, and
    exported to `<run_dir>/final_ema` as its own `from_pretrained` directory.

    The average is a shadow of each process's own parameter tensors (under FSDP its shards, so it is sharded too),
    updated as `ema = lerp(ema, weights, 1 - decay)` (the first update copies). To evaluate or export it, the shadow
    is swapped into the live model and back, bit for bit. Its state dict holds the full tensors
    (`module.<name>`, `n_averaged`: the layout of `torch.optim.swa_utils.AveragedModel`)."""

    def __init__(self, decay: float = 0.999, start_step: int = 0, every: int = 1):
        self.decay, self.start_step, self.every = decay, start_step, every
        self.params: dict = {}  # name -> the live parameter (a DTensor under FSDP), from on_train_start on
        self.shadow: list = []  # this process's part of each averaged parameter, in the order of `params`
        self.n_averaged = 0
        self._loaded: dict | None = None  # a checkpoint's EMA state, loaded before the shadow existed

    def on_train_start(self, run):
        # plain names (torch.compile inserts `_orig_mod.`): the state dict is the same compiled or not
        model = run.accelerator.unwrap_model(run.model)
        self.params = {name.replace("_orig_mod.", ""): p for name, p in model.named_parameters()}
        self.shadow = [local(p).clone() for p in self.params.values()]
        if self._loaded is not None:
            self.load_state_dict(self._loaded)

    def on_step_end(self, run):
        step = run.state.step
        if step >= self.start_step and (step - self.start_step) % self.every == 0:
            with torch.no_grad():
                live = [local(p) for p in self.params.values()]
                if self.n_averaged == 0:
                    torch._foreach_copy_(self.shadow, live)
                else:
                    torch._foreach_lerp_(self.shadow, live, 1 - self.decay)
            self.n_averaged += 1

    @contextlib.contextmanager
    def swapped_in(self):
        """Inside, the live model holds the averaged weights; after, its own again (even after an error)."""
        def swap():
            with torch.no_grad():
                for p, s in zip(self.params.values(), self.shadow):
                    mine = local(p).clone()
                    local(p).copy_(s)
                    s.copy_(mine)

        swap()
        try:
            yield
        finally:
            swap()

    def on_eval_end(self, run, metrics):
        if self.n_averaged == 0:
            return  # nothing averaged yet (before start_step)
        with self.swapped_in():
            ema_metrics = run.evaluate(run.model)
        if ema_metrics is not None:  # logged with the raw metrics, as eval_ema/*
            metrics.update({f"ema_{k}": v for k, v in ema_metrics.items()})

    def on_train_end(self, run):
        if self.n_averaged > 0:
            with self.swapped_in():
                run.export(run.model, run.run_dir / "final_ema")

    def state_dict(self) -> dict:
        """Full tensors (gathered from the shards under FSDP: call it on every process)."""
        full = {f"module.{name}": whole(p, s) for (name, p), s in zip(self.params.items(), self.shadow)}
        return {**full, "n_averaged": torch.tensor(self.n_averaged)}

    def load_state_dict(self, state: dict) -> None:
        if not self.params:
            self._loaded = state
            return
        with torch.no_grad():
            for (name, p), s in zip(self.params.items(), self.shadow):
                s.copy_(part(p, state[f"module.{name}"].to(s.device)))
        self.n_averaged = int(state["n_averaged"])
        self._loaded = None


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter, sharing its storage: the local shard of a DTensor, or the tensor."""
    t = t.detach()
    return t.to_local() if isinstance(t, DTensor) else t


def whole(p: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """The full tensor of which `mine` is this process's part, laid out as `p` (a collective for a DTensor)."""
    if not isinstance(p, DTensor):
        return mine  # saved right away; no copy needed
    return DTensor.from_local(mine, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()


def part(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This process's part of `full`, laid out as the parameter `p`."""
    return distribute_tensor(full, p.device_mesh, p.placements).to_local() if isinstance(p, DTensor) else full


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
            if not (path / "metrics.json").is_file():  # only a regular file is read: a FIFO there would block forever
                continue
            try:
                found.append((json.loads((path / "metrics.json").read_text())[self.metric], path))
            except (OSError, ValueError, KeyError):
                continue  # a directory a crash left half-written: it is replaced or rotated away
        return sorted(found, key=lambda vp: vp[0] if self.mode == "min" else -vp[0])

    def on_eval_end(self, run, metrics):
        value = metrics[self.metric]
        if not math.isfinite(value):
            run.accelerator.print(f"warning: step {run.state.step}: checkpoint.best_metric {self.metric} is {value}; "
                                  f"this model is not ranked among the best")
            return
        ranked = self.ranked(run.run_dir)
        if len(ranked) >= self.keep and not improved(value, ranked[self.keep - 1][0], self.mode):
            return
        target = run.run_dir / "best" / f"step_{run.state.step:08d}"
        # collective (every process calls it); metrics.json is written inside the atomic export
        with self.ema.swapped_in() if self.metric.startswith("ema_") else contextlib.nullcontext():
            run.export(run.model, target, {"metrics.json": json.dumps({"step": run.state.step, **metrics})})
        if run.accelerator.is_main_process:
            for _, old in self.ranked(run.run_dir)[self.keep:]:
                shutil.rmtree(old, ignore_errors=True)
        run.accelerator.wait_for_everyone()


def best_model(run: RunContext, ck) -> tuple[tuple[Path, int, str, float] | None, bool]:
    """At the end of a run: the best model `checkpoint.keep_best` kept (its directory, step, metric and value; `ck`
    is the recipe's `checkpoint` section), and whether `final/` is it: copied over the last weights with
    `checkpoint.best_at_end` (by the main process, staged beside it and swapped in by renames, so a crash never
    leaves a half-copied `final/`), or the last weights being the best (not EMA weights ranked by an `ema_*`)."""
    ranked = KeepBest(ck.keep_best, ck.best_metric, ck.best_mode).ranked(run.run_dir) if ck.keep_best else []
    if not ranked:
        return None, False
    value, path = ranked[0]
    best = (path, json.loads((path / "metrics.json").read_text())["step"], ck.best_metric, value)
    if ck.best_at_end:
        if run.accelerator.is_main_process:
            final = run.run_dir / "final"
            staged, old = final.with_name(".final.best"), final.with_name(".final.last")
            shutil.rmtree(staged, ignore_errors=True)
            shutil.copytree(path, staged)
            (staged / "metrics.json").unlink(missing_ok=True)  # the ranking's record: best/ keeps it
            final.rename(old)
            staged.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        run.accelerator.wait_for_everyone()
        return best, True
    return best, best[1] == run.state.step and not ck.best_metric.startswith("ema_")
