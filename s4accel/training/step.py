"""One optimizer step: the micro-batch window (forward and backward, item-normalised under accumulation and several
processes), clipping, the agreement of every process on what happened (non-finite numbers, a stop signal, a callback
asking to stop, a save due by time), the non-finite skip, the update; and the window's rewind when a stop signal cuts
it short."""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from ..errors import NonFiniteError
from ..models.moe import ROUTER_LOSSES, router_outputs
from .callbacks import local
from .devices.graphs import GraphReport, captures_graphs, keep
from .runs.checkpoint import TrainState, latest_complete, save_checkpoint
from .task import Task, TrainOptimizer, WindowStats, count_items


def batch_stream(accelerator, train_dl, state: TrainState, on_epoch_start=lambda: None, on_epoch_end=lambda: None):
    """Micro-batches forever, epoch after epoch; `set_epoch` reshuffles each epoch identically on every rank. After a
    mid-epoch resume, the first epoch skips the batches the checkpointed run had consumed: with the seedable sampler
    this replays exactly the batches an uninterrupted run sees (with any other sampler setup, or without
    `set_epoch`, a resumed epoch is shuffled differently). The epoch hooks run before an epoch's first micro-batch
    and once its last one was consumed."""
    skip = state.batch_in_epoch
    while True:
        on_epoch_start()
        if hasattr(train_dl, "set_epoch"):  # a prepared (sharded, device-placing) loader
            train_dl.set_epoch(state.epoch)
            batches = train_dl
            if skip:
                batches = accelerator.skip_first_batches(train_dl, skip)
                # Accelerate before 1.15 builds the skipping loader with its epoch counter at 0, and a loader sets
                # its sampler's epoch from that counter when iterated: the resumed epoch would be shuffled as epoch 0.
                batches.set_epoch(state.epoch)
        elif getattr(train_dl.dataset, "resumable", False):  # a data stream (data.streaming): endless, it resumes at
            # the position restored from the checkpoint, so nothing is skipped
            batches = ({k: v.to(accelerator.device) for k, v in b.items()} for b in train_dl)
        else:  # the stream loader of stateful training: in order, on the CPU
            batches = ({k: v.to(accelerator.device) for k, v in b.items()}
                       for b in itertools.islice(train_dl, skip, None))
        try:
            for batch in batches:
                state.batch_in_epoch += 1
                yield batch
        except GeneratorExit:  # the loop closes the stream when the run ends: a pass whose last batch the last step
            # consumed (train.max_epochs) has ended too, though no batch of the next was asked for
            try:
                finished = state.batch_in_epoch == _length(train_dl)
            except Exception:  # closed by the garbage collector after a run that failed: its dataset half torn down
                finished = False
            if finished:
                on_epoch_end()
            raise
        on_epoch_end()
        skip = 0
        state.epoch += 1
        state.batch_in_epoch = 0


def _length(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:  # a stream
        return None


def backward_window(accelerator, model, window: list[dict], task: Task | None = None, step: int = 0,
                    abort=None, graphs: bool = False) -> dict | None:
    """Forward and backward over the micro-batches of one optimizer step (automatic optimisation); returns this rank's
    share of the window's training scalars (`loss`, and for mixture-of-experts models `aux_loss`, `expert_counts`,
    `dropped_counts`). Without a task, `model(**batch)` is the step. With `abort` (a stop signal's flag), every
    process checks it together between micro-batches and all return None as soon as one saw it, unless the window's
    end is near (the last eighth of it, at least its last micro-batch, is finished instead); one small collective per
    checked micro-batch with several processes, nothing with one.

    Item-normalised (the mean of per-micro-batch means would weigh a short micro-batch's items more): the task's
    loss is its micro-batch's mean over `count_items(batch)` (real target tokens for
    a language model); weighting it by that count over the count of the whole window on all ranks makes the window's
    gradient that of the mean over all its items, so ragged micro-batches weigh by their items. Multiplying by
    grad_accum x num_processes cancels backward's 1/grad_accum (Accelerate divides by it already) and DDP's mean over
    ranks. One collective.
    An `aux_loss` (router losses, included in the model's `loss`) is its own micro-batch's mean, so it is taken out
    of that weighting: backward's 1/grad_accum and DDP's mean make it the mean over the window's micro-batches.
    `graphs`: the model replays CUDA graphs, whose outputs the next micro-batch overwrites: what is kept is copied.
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
            router = {} if isinstance(out, torch.Tensor) else router_outputs(out)
            loss, aux = (out, None) if isinstance(out, torch.Tensor) else (out["loss"], router.get("aux_loss"))
            mean = loss - aux if aux is not None else loss
            share = mean * (counts[i] / n_items) if n_items is not None else mean  # of the window's mean
            objective = share * (ga * n_proc) if n_items is not None else share  # (one micro-batch, one process: 1)
            accelerator.backward(objective + aux if aux is not None else objective)
        parts = {"loss": share.detach()}
        for key, value in router.items():
            # losses: summed over the window and the processes they make the mean; counts: summed
            parts[key] = value.detach() / (ga * n_proc) if key in ROUTER_LOSSES else value
        if graphs:
            parts = {k: keep(v) for k, v in parts.items()}
        for k, v in parts.items():
            totals[k] = totals[k] + v if k in totals else v
    return totals


def manual_window(accelerator, model, window: list[dict], task: Task, step: int, abort=None,
                  graphs: bool = False) -> dict | None:
    """Manual optimisation: the task's `training_step` runs on each micro-batch (its `step()` calls act on the last);
    returns this rank's share of the mean of the scalars it returned, and the gradient norms of its steps. `abort`:
    as for `backward_window` (no optimizer has stepped before the window's last micro-batch). `graphs`: nothing to
    copy, the totals are new tensors."""
    ga, n_proc = accelerator.gradient_accumulation_steps, accelerator.num_processes
    near = max(1, ga // 8)
    stats = task.context.window = WindowStats()  # what the task's step() calls record in this window
    totals: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(window):
        if i and abort is not None and ga - i > near and agree(accelerator, None, signal=abort()).signal:
            return None
        with accelerator.accumulate(model):  # sets sync_gradients on the window's last micro-batch
            out = task.training_step(model, batch, step) or {}
        for k, v in out.items():
            v = torch.as_tensor(v).detach().float() / (ga * n_proc)
            totals[k] = totals[k] + v if k in totals else v
    return {**totals, **{f"grad_norm_{name}": norm for name, norm in stats.grad_norms.items()}}


def clip_gradients(accelerator, params: list, cfg) -> torch.Tensor:
    """Clip by value or by norm; return the global gradient norm (before norm clipping) for logging."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed's engine has clipped and stepped already (zero.py); it keeps the norm it measured before clipping
        # (inf when it dropped the update for non-finite gradients), or None when told not to measure it.
        norm = accelerator.clip_grad_norm_(params, cfg.clip_grad_norm)
        return None if norm is None else torch.as_tensor(norm, dtype=torch.float32)
    if cfg.clip_grad_value is not None:
        accelerator.clip_grad_value_(params, cfg.clip_grad_value)  # also unscales fp16 gradients
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    else:  # an infinite max norm only measures; called once per step, as fp16's unscale_ must be (twice raises)
        norm = accelerator.clip_grad_norm_(params, cfg.clip_grad_norm or math.inf)
    # Under FSDP2 the gradients are sharded DTensors and so is their norm: the full value, the same on every process.
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def step_optimizers(accelerator, optimizers: list[TrainOptimizer], state: TrainState, overflow: bool = False
                    ) -> None:
    """Step every optimizer, then its schedule, unless fp16's gradients overflowed (`overflow`: their norm, taken
    after the GradScaler unscaled them, is not finite): then no optimizer steps, the scaler lowers its scale, and the
    skipped step is counted and does not advance the learning rate. The schedules are not prepared by Accelerate,
    which would step them once per process per optimizer step.

    Under fp16 the GradScaler steps each optimizer and updates once, after all of them (torch's recipe for several
    optimizers): Accelerate's optimizer `step` updates it after each one, which made it forget that the clipping had
    unscaled the next one's gradients, so Muon's AdamW stepped on gradients divided by the scale twice."""
    scaler = accelerator.scaler
    if scaler is None:
        for o in optimizers:
            o.optimizer.step()
    else:
        scale = scaler.get_scale()
        if not overflow:
            for o in optimizers:
                scaler.step(o.optimizer.optimizer)  # the torch optimizer inside Accelerate's wrapper
        scaler.update()
        # clipping by value clamps an infinite gradient: the scaler, which saw it when unscaling, still skipped
        overflow = overflow or scaler.get_scale() < scale
    if overflow:
        state.scaler_skips += 1
    else:
        for o in optimizers:
            o.scheduler.step()
    state.consecutive_nonfinite = 0
    for o in optimizers:
        o.optimizer.zero_grad(set_to_none=True)


class Flags(NamedTuple):
    """What the processes agreed on at a step: some saw non-finite numbers, got a stop signal, have a callback
    asking to stop, have a time-based save due, have spent `train.max_time`."""

    nonfinite: bool = False
    signal: bool = False
    stop: bool = False
    save: bool = False
    out_of_time: bool = False

    def merge(self, other: Flags) -> Flags:
        return Flags(*(a or b for a, b in zip(self, other)))


def agree(accelerator, nonfinite: torch.Tensor | None, signal=False, stop=False, save=False,
          out_of_time=False) -> Flags:
    """The flags of any process, the same on every process, so none of them breaks out of a collective alone
    (the others would wait in it forever; each process reads its own clock).
    One host sync for the non-finite check; one small all-reduce with several processes; nothing more on one."""
    if accelerator.num_processes == 1:
        return Flags(bool(nonfinite) if nonfinite is not None else False, signal, stop, save, out_of_time)
    flags = torch.tensor([0.0, signal, stop, save, out_of_time], device=accelerator.device)
    if nonfinite is not None:
        flags[0] = nonfinite.float()
    return Flags(*(v > 0 for v in accelerator.reduce(flags, reduction="sum").tolist()))


def skip_nonfinite_step(accelerator, model, optimizers: list[TrainOptimizer], state, recipe) -> None:
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
            path = save_checkpoint(accelerator, recipe.run.dir, state.step, recipe.checkpoint.keep_last,
                                   recipe.to_yaml())
            where = f"saved in {path}"
        else:
            good = latest_complete(recipe.run.dir)
            where = f"{good}" if good else "not saved (no checkpoint yet)"
        raise NonFiniteError(f"non-finite loss or gradient norm at step {state.step + 1} ({why}); the last good state "
                             f"is {where}")


def weights_finite(accelerator, model) -> bool:
    """Whether every parameter is finite on every process (one norm per tensor, one small all-reduce)."""
    tensors = [local(p) for p in model.parameters()]
    ok = torch.stack(torch._foreach_norm(tensors)).isfinite().all() if tensors else torch.tensor(True)
    return not agree(accelerator, ~ok.to(accelerator.device)).nonfinite


def save_checked(accelerator, model, run_dir: Path, step: int, recipe) -> Path:
    """A checkpoint of weights that are finite: an update that made them non-finite (a learning rate too large) is
    stopped here rather than saved as the state to resume from."""
    if not weights_finite(accelerator, model):
        good = latest_complete(run_dir)
        raise NonFiniteError(f"the weights are no longer finite after step {step} (an update made them so: optim.lr "
                             f"too large?); not saving them; the last good state is "
                             f"{good or 'not saved (no checkpoint yet)'}")
    return save_checkpoint(accelerator, run_dir, step, recipe.checkpoint.keep_last, recipe.to_yaml())


class Rewind:
    """What one optimizer step's window changes besides gradients (the data position, the random streams, a
    task's carried state), captured at its start, to go back to the last complete step when a stop signal cuts the
    window short: the checkpoint then holds exactly the state a step boundary would have."""

    def __init__(self, accelerator, state: TrainState, task: Task):

        self.accelerator, self.state, self.task = accelerator, state, task
        # accelerate counts micro-batches to know which one synchronises gradients, and saves that count
        self.position = (state.epoch, state.batch_in_epoch, accelerator.step)
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        self.carried = [(obj, obj.snapshot()) for obj in task.stateful() if hasattr(obj, "snapshot")]

    def __call__(self, optimizers: list[TrainOptimizer]) -> None:

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


class Clock:
    """Time-based checkpoints: due every `minutes` of training (never when None)."""

    def __init__(self, minutes: float | None):
        self.seconds = None if minutes is None else 60 * minutes
        self.reset()

    def reset(self):
        self.start = time.monotonic()

    def due(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.start >= self.seconds


class TimeBudget:
    """`train.max_time`: the loop's wall time added to `state.train_seconds` (what the run spent before, kept up to
    date for the checkpoints), and whether that has reached the limit (never when None)."""

    def __init__(self, limit_s: float | None, state: TrainState):
        self.limit_s, self.state, self.last = limit_s, state, time.monotonic()

    def spent(self) -> bool:
        now = time.monotonic()
        self.state.train_seconds += now - self.last
        self.last = now
        return self.limit_s is not None and self.state.train_seconds >= self.limit_s


@dataclass
class StepOutcome:
    flags: Flags
    """What every process agreed on at this step."""
    scalars: dict | None = None
    """This process's share of the step's training scalars (None when no step was taken)."""
    skipped: bool = False
    """Non-finite numbers: the update was dropped (the loop goes on to the next window)."""
    aborted: bool = False
    """A stop signal cut the window short: the state is back at the last complete step."""


class Stepper:
    """One optimizer step per call: the micro-batch window (abandoned and rewound when a stop signal arrives in its
    middle), clipping, the agreement of every process (non-finite numbers, a stop signal, a callback asking to stop,
    a save due by time, `train.max_time` spent), the non-finite skip, the update of every optimizer and its
    schedule, the counters."""

    def __init__(self, accelerator, model, task: Task, optimizers: list[TrainOptimizer], recipe, signals, layout=None,
                 state: TrainState | None = None):
        self.accelerator, self.model, self.task, self.optimizers = accelerator, model, task, optimizers
        self.split = layout.split if layout is not None else (lambda batch: batch)  # context parallelism's chunk
        self.recipe, self.cfg, self.signals = recipe, recipe.train, signals
        self.params = [p for p in model.parameters() if p.requires_grad]  # what clipping sees, listed once
        self.clock = Clock(recipe.checkpoint.every_minutes)  # time-based checkpoints
        self.budget = TimeBudget(recipe.train.max_time_s, state) if state is not None else None  # train.max_time
        self.graphs, self.graph_report = captures_graphs(accelerator), GraphReport(accelerator)

    def __call__(self, batches, state: TrainState, stop_requested: bool) -> StepOutcome:
        acc, task, cfg = self.accelerator, self.task, self.cfg
        # A stop signal between micro-batches abandons a long window: back to the last complete step (grad_accum > 1).
        rewind = Rewind(acc, state, task) if cfg.grad_accum > 1 else None
        window = [self.split(next(batches)) for _ in range(cfg.grad_accum)]
        run_window = backward_window if task.automatic_optimization else manual_window
        scalars = run_window(acc, self.model, window, task, state.step,
                             abort=self.signals.interrupted if rewind else None, graphs=self.graphs)
        if scalars is None:
            rewind(self.optimizers)
            return StepOutcome(Flags(signal=True), aborted=True)
        if task.automatic_optimization:
            # The window's last micro-batch synchronised the gradients: all below happens once per step.
            norm = clip_gradients(acc, self.params, cfg)
            if norm is not None:  # None when DeepSpeed was configured not to measure it
                scalars["grad_norm"] = norm
            total = scalars["loss"]  # a NaN or inf in any of these makes the sum one
            # under fp16 overflowing gradients are the GradScaler's to skip (step_optimizers), not a bad number
            for key in ("aux_loss",) if acc.scaler is not None else ("aux_loss", "grad_norm"):
                total = total + scalars[key] if key in scalars else total
            # one process: read as a number (the host sync the check needs anyway, without two more tensor ops)
            nonfinite = ~torch.isfinite(total) if acc.num_processes > 1 else not math.isfinite(total.item())
        else:  # the task stepped its optimizers itself, on the window's last micro-batch
            nonfinite = torch.tensor(task.context.window.nonfinite_steps > 0)
            state.scaler_skips += task.context.window.scaler_skips
        # One check per step, the same decision on every process: a process that broke out of a collective alone
        # would leave the others waiting in it forever.
        flags = agree(acc, nonfinite, signal=self.signals.interrupted(), stop=stop_requested, save=self.clock.due(),
                      out_of_time=self.budget is not None and self.budget.spent())
        if flags.nonfinite:
            if task.automatic_optimization and acc.scaler is not None:
                acc.scaler.update()  # the clipping unscaled the gradients: without an update the next unscale raises
            skip_nonfinite_step(acc, self.model, self.optimizers, state, self.recipe)
            return StepOutcome(flags, skipped=True)
        if task.automatic_optimization:
            overflow = acc.scaler is not None and not math.isfinite(scalars["grad_norm"])
            step_optimizers(acc, self.optimizers, state, overflow)
        state.consecutive_nonfinite = 0
        state.step += 1
        state.tokens_seen += sum(task.count_units(b) for b in window) * acc.num_processes
        self.graph_report.after_step()
        return StepOutcome(flags, scalars)
