"""How long a run is, worked out once when its loaders exist: a frozen `Plan` the loop, the task's schedules and the
tools read, instead of a length written back into the recipe (which stays as it was loaded)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RecipeError


@dataclass(frozen=True)
class Plan:
    batches_per_epoch: int | None
    """Training batches each process draws per pass over the data; None for a stream (no epochs)."""
    total_steps: int
    """Optimizer steps: `train.max_steps`, or what `train.max_epochs` comes to (the smaller when both are set)."""
    warmup_steps: int
    """The schedule's warmup, `scheduler.warmup_steps` or `warmup_ratio` of `total_steps`, at most `total_steps`."""
    warmup_note: str | None = None
    """Says that a warmup longer than the run was cut to it (the run prints it); None when it was not."""


def make_plan(recipe, train_dl, num_processes: int, sharded: bool) -> Plan:
    """The run's plan from its training loader. A loader that `accelerator.prepare` shards deals its batches out in
    turn and, unless the loader drops the last partial batch, pads the last round so that every process draws as many
    (Accelerate's `even_batches`); an unsharded loader is this process's own already."""
    batches = _length(train_dl)
    if batches is not None and sharded and num_processes > 1:
        drop_last = getattr(getattr(train_dl, "batch_sampler", None), "drop_last", False)
        batches = batches // num_processes + (0 if drop_last or batches % num_processes == 0 else 1)
    for key, instead, by_epochs in (("train.max_epochs", "set train.max_steps", recipe.train.max_epochs is not None),
                                    ("train.eval_every", "evaluate every N steps", recipe.train.eval_every == "epoch")):
        if by_epochs and batches is None:
            raise RecipeError(f"{key}: this task's training data has no length (a stream has no epochs); {instead} "
                              f"instead")
        if by_epochs and batches == 0:
            raise RecipeError(f"{key}: the training data makes no full batch per process; lower data.batch_size or "
                              f"{instead}")
    total = recipe.total_steps_for(batches)
    return Plan(batches, total, recipe.warmup_steps_for(total), recipe.warmup_note(total))


def _length(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without __len__
        return None
