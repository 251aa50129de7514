"""`s4accel train RECIPE --fast-dev-run [N]` (Lightning's `fast_dev_run`): the whole run, end to end, in the time of
a few steps, before the hours of the real one. The recipe's data, tokenizer, model, optimizer, task, callbacks,
precision and launcher, through N optimizer steps, an evaluation of N validation batches, a checkpoint and the export
with its samples, in a scratch run directory beside the real one, deleted once it passes. What would outlive the
check or hide its end is off: trackers (a remote one would record a throwaway run), the Hub push, early stopping, the
profiler, the time budget, kept best models. The schedule is the recipe's, its warmup cut to the N steps."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..config import Recipe, validate_recipe
from ..errors import RecipeError


def scratch_dir(run_dir: Path) -> Path:
    """Beside the run directory (on the filesystem every process of a launch shares, as the real run will be), the
    same path on every process."""
    run_dir = Path(run_dir).absolute()
    return run_dir.with_name(f".{run_dir.name}.fast-dev-run")


def fast_dev_recipe(recipe: Recipe, steps: int, resume: str | None = None) -> Recipe:
    """The recipe cut to `steps` optimizer steps, an evaluation and a checkpoint at the last, in `scratch_dir`."""
    if steps < 1:
        raise RecipeError(f"--fast-dev-run {steps}: expected a number of optimizer steps, 1 or more")
    if resume is not None:
        raise RecipeError("--fast-dev-run checks a run from its start in a scratch directory: it does not resume "
                          "(leave out --resume, or --set train.resume=null)")
    d = recipe.to_dict()
    d["run"].update(out_dir=str(scratch_dir(recipe.run.dir)), overwrite=True)
    d["train"].update(max_steps=steps, max_epochs=None, eval_every=steps, eval_max_batches=steps, resume=None,
                      early_stopping=None, profile=None, max_time=None)
    d["scheduler"]["warmup_steps"] = min(d["scheduler"]["warmup_steps"], steps)  # cut without the line saying so
    d["checkpoint"].update(every_steps=steps, every_minutes=None, keep_best=0, best_at_end=False)
    d["log"]["log_with"] = []
    d["hub"]["push_at_end"] = False
    d["sample"]["max_new_tokens"] = min(d["sample"]["max_new_tokens"], 16)  # the generation path, not its length
    return validate_recipe(d, "--fast-dev-run")


def remove_scratch(run_dir: Path) -> None:
    """The scratch run directory, once the check passed (one that failed is left for its train.log)."""
    shutil.rmtree(run_dir, ignore_errors=True)


def passed_line(result, seconds: float, metrics: str) -> str:
    steps = f"{result.steps} optimizer step{'s' if result.steps != 1 else ''}"
    evaluated = f"an evaluation ({metrics})" if metrics else "an evaluation (no validation data)"
    return (f"fast dev run passed in {seconds:.1f}s: {steps}, {evaluated}, a checkpoint and the export; the scratch "
            f"run directory is deleted")
