"""Evaluation: the task's per-sample values summed (or kept whole, `Task.gathered`) over the whole validation split on
every process (duplicates of the padded last batch dropped), the task's metrics and the recipe's own from them, their
report to callbacks, trackers and the console, and when a run evaluates."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..config.data_sections import PER_CLASS_METRICS
from .callbacks import CallbackList, RunContext, improved
from .observe.class_scores import confusion_text
from .devices.context_parallel import whole_sequences
from .observe.recipe_metrics import metric_functions, recipe_metrics
from .step import agree
from .task import Task


@torch.no_grad()
def gathered_sums(accelerator, model, val_dl, per_sample, abort=lambda: False, progress: bool = False,
                  keep: tuple[str, ...] = (), desc: str = "eval") -> tuple[dict, int] | None:
    """Sum `per_sample(model, batch) -> {name: (B,) or (B, k)}` over the whole evaluation split on all processes:
    the rows go through `gather_for_metrics`, which drops the duplicates padding the last batch. Returns the sums
    (floats, or lists for (B, k) values) and the number of samples; the values named in `keep` come whole instead:
    every sample's, from all processes, as one CPU tensor of the dtype they were returned in (predictions and labels,
    for the metrics a sum cannot give). None when `abort()` (a stop signal) becomes true on any process, checked
    before each batch. `progress`: a bar on the main process, named `desc` (it goes when done).

    The training RNG streams come out untouched (each new DataLoader iterator draws a seed from the global RNG):
    how often a run evaluates, and whether an evaluation was cut short, never changes what training computes. A
    model split along the sequence (`train.context_parallel`) reads whole sequences here, the loader's own (no
    gradient is kept, so a process holds one layer's activations at a time)."""
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), whole_sequences(accelerator, model):
        was_training = model.training
        model.eval()
        totals, widths, kept = None, None, []
        try:
            bar = tqdm(val_dl, desc=desc, leave=False, dynamic_ncols=True,
                       disable=not (progress and accelerator.is_main_process))
            for batch in bar:
                if agree(accelerator, None, signal=abort()).signal:
                    return None
                with accelerator.autocast():  # a model copy that did not go through prepare() (EMA) gets it too
                    values = per_sample(model, batch)
                    cols = [v.reshape(v.shape[0], -1).double() for v in values.values()]
                    cols.append(torch.ones_like(cols[0][:, :1]))  # counts the samples
                    rows = accelerator.gather_for_metrics(torch.cat(cols, dim=1))
                widths = widths or {k: c.shape[1] for k, c in zip(values, cols)}
                totals = rows.sum(0) if totals is None else totals + rows.sum(0)
                if keep:  # float64 holds any class id or float32 value exactly
                    kept.append(rows.cpu())
        finally:
            model.train(was_training)
    if totals is None:
        raise ValueError("the validation loader yielded no batch")
    parts, whole = totals.tolist(), torch.cat(kept) if kept else None
    sums, i = {}, 0
    for key, width in widths.items():
        if key in keep:
            column = whole[:, i: i + width]
            sums[key] = (column[:, 0] if values[key].dim() == 1 else column).to(values[key].dtype)
        else:
            sums[key] = parts[i] if width == 1 and values[key].dim() == 1 else parts[i: i + width]
        i += width
    return sums, int(parts[-1])


def evaluate(accelerator, task: Task, model, loaders, abort=lambda: False, progress: bool = False) -> dict | None:
    """The task's metrics over the whole validation split, gathered over processes, and the recipe's own
    (`task.metrics`) on the gathered predictions and labels; None if a stop cut it short. `loaders`: the validation
    loader, or loaders by name, `""` the validation split's (plain metric names) and each more evaluation set's
    (`data.eval_sets`: its metrics as `<name>/<metric>`), evaluated in that order."""
    loaders = loaders if isinstance(loaders, dict) else {"": loaders}
    functions = metric_functions(task.recipe, task)
    out = {}
    for name, loader in loaders.items():
        sums = gathered_sums(accelerator, model, loader, task.validation_step, abort, progress, task.gathered,
                             f"eval {name}" if name else "eval")
        if sums is None:
            return None
        metrics = task.compute_metrics(*sums)
        say = lambda line: accelerator.print(f"warning: {f'{name}: ' if name else ''}{line}")  # noqa: E731
        metrics.update(recipe_metrics(functions, sums[0], metrics, say))
        out.update({f"{name}/{k}" if name else k: v for k, v in metrics.items()})
    return out


def evaluate_and_report(run: RunContext, callbacks: CallbackList, bar) -> dict | None:
    """Evaluate the model, let callbacks add to and act on the metrics (EMA, keep-best, early stopping), log them.
    One a stop signal cuts short is None, and marked in the state for the resumed run to do again."""
    run.state.eval_cut_at = run.state.step
    metrics = run.evaluate(run.model)
    if metrics is None:  # interrupted by a stop signal
        return None
    run.state.eval_cut_at = None
    callbacks.on_eval_end(run, metrics)
    ck = run.recipe.checkpoint
    if ck.best_metric in metrics and improved(metrics[ck.best_metric], run.state.best_metric, ck.best_mode):
        run.state.best_metric = metrics[ck.best_metric]
    run.log({(f"eval_ema/{k[4:]}" if k.startswith("ema_") else f"eval/{k}"): v for k, v in loggable(metrics).items()})
    if run.accelerator.is_main_process:
        bar.write(f"step {run.state.step}: {headline(metrics)}")
    return metrics


def eval_at_start(run: RunContext, callbacks: CallbackList, bar) -> dict:
    """The evaluation before the loop's first step: with `train.eval_at_start`, a new run's model (step 0); in a
    resumed run, the evaluation a stop signal cut short at the step it resumes from (keep-best, early stopping and
    the logs then see what the uninterrupted run saw). {} when there is none (or a stop signal cut it short)."""
    due = run.state.step == 0 and run.recipe.train.eval_at_start
    if not (due or run.state.eval_cut_at == run.state.step):
        return {}
    return evaluate_and_report(run, callbacks, bar) or {}


def eval_sets_note(data) -> str:
    """The more evaluation sets of a run's data for its first line: ` + 2 eval sets (news 40, test 12 examples)`
    (examples: packed blocks of text, documents, sequences)."""
    sets = getattr(data, "eval_sets", None) or {}
    sizes = ", ".join(f"{name} {len(ds):,}" for name, ds in sets.items())
    return f" + {len(sets)} eval set{'s' if len(sets) > 1 else ''} ({sizes} examples)" if sets else ""


def loggable(metrics: dict) -> dict:
    """What trackers take: numbers as they are; a confusion matrix as a Markdown table (TensorBoard's text panel
    shows it), anything else as JSON text."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict) and "matrix" in value:
            value = confusion_text(value)
        elif not isinstance(value, (int, float, str)):
            value = json.dumps(value)
        out[key] = value
    return out


def headline(metrics: dict) -> str:
    """The metrics a console line shows: the numbers, without per-class ones (`precision/<class>`) or matrices,
    which go to the trackers and `s4accel eval --json`; each more evaluation set's (`news/loss`) after its name:
    `loss 2.1000, ppl 8.1662 | news: loss 2.5000, ppl 12.1825`."""
    groups: dict[str, dict] = {"": {}}
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        ema, plain = ("ema_", key[4:]) if key.startswith("ema_") else ("", key)
        where, _, name = plain.rpartition("/")
        if where and ("/" in where or where in PER_CLASS_METRICS or name not in metrics):
            continue  # a per-class score, the main set's or an evaluation set's
        groups.setdefault(where, {})[ema + name] = value
    parts = [", ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}" for k, v in group.items())
             for group in groups.values()]
    return " | ".join(f"{where}: {part}" if where else part for where, part in zip(groups, parts) if part)


def evaluation_schedule(every: int | str, plan, state) -> Callable[[], bool]:
    """Whether the optimizer step just taken is due an evaluation: every `every` steps (0: never) and the run's last;
    with `epoch`, each step whose window finished a pass over the training data (a window spanning a pass's end
    finishes it) and the last. Passes are counted from the loop's state, so a resumed run evaluates where an
    uninterrupted one does."""
    total = plan.total_steps
    if every != "epoch":
        return lambda: bool(every and state.step % every == 0) or state.step == total

    def passes() -> int:  # a pass whose last micro-batch was drawn counts: the next begins when its first batch is
        return state.epoch + (state.batch_in_epoch >= plan.batches_per_epoch)

    seen = passes()

    def after_a_pass() -> bool:
        nonlocal seen
        ended, seen = passes() > seen, passes()
        return ended or state.step == total

    return after_a_pass
