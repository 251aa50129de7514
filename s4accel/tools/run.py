"""`s4accel.train(recipe)`: the training loop, then the Hub push the recipe asks for (`hub.push_at_end`), once
everything is saved (a failed push loses nothing)."""

from __future__ import annotations

from pathlib import Path

from ..config import Recipe, load_recipe
from ..training import TrainResult
from ..training import train as train_loop
from ..training.evaluate import headline
from .fast_dev_run import fast_dev_recipe, remove_scratch
from .hub import push_run
from .launcher import continue_command


def train(recipe: Recipe | str | Path, overrides: list[str] | tuple[str, ...] = (), resume: str | None = None,
          force: bool = False, fast_dev_run: int | None = None) -> TrainResult:
    """Train the model a recipe describes (`s4accel.training.train`), then push it to the Hub if the recipe says so.
    Works under `accelerate launch`.

    fast_dev_run: instead, check the run end to end (Lightning's `fast_dev_run`): N optimizer steps, an evaluation of
        N validation batches, a checkpoint and the export, in a scratch directory deleted once they pass
        (`tools/fast_dev_run.py`); the recipe's run directory is not touched. The result's paths are None."""
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, overrides)
    if fast_dev_run is not None:
        result = train_loop(fast_dev_recipe(recipe, fast_dev_run, resume))
        if result.is_main_process:  # passed, or stopped by Ctrl-C: nothing to keep (an error leaves its train.log)
            remove_scratch(result.run_dir)
        result.final_dir = result.checkpoint = result.best = None
        return result
    result = train_loop(recipe, resume=resume, force=force)
    hub = recipe.hub
    if hub.push_at_end and result.final_dir is not None and result.is_main_process:
        url = push_run(result.run_dir, hub.repo_id, private=hub.private, revision=hub.revision, which=hub.which)
        print(f"pushed the {hub.which} model to {hub.repo_id}: {url}")
    return result


def result_line(result: TrainResult) -> str:
    """The run's last line: `done: ...` with its metrics, speed and where the model is, or `stopped at step ...` with
    the command that continues it."""
    if result.preempted:
        # The run directory carries the resolved recipe, --set items included: resuming from it needs nothing else;
        # under a launcher, the launcher's command resumes it on the same processes.
        command, where = continue_command(result.run_dir)
        line = (f"stopped at step {result.steps} ({result.stop_reason}); checkpoint {result.checkpoint}; "
                f"continue with{where}: {command}")
    else:
        metrics = headline(result.eval_metrics)  # per-class scores and matrices are in the trackers
        why = f" (stopped early: {result.stop_reason})" if result.stop_reason else ""
        rate = result.throughput
        speed = (f" ({rate['tflops']:.3g} TFLOP/s" + (f", MFU {rate['mfu']:.1%}" if "mfu" in rate else "") + ")"
                 if "tflops" in rate else "")
        line = (f"done: {result.steps} steps in {result.loop_seconds:.1f}s{speed}{why}; {metrics}; model in "
                f"{result.final_dir}")
        if result.best is not None:  # where the best model is, when final/ does not say it already
            path, step, metric, value = result.best
            said = f"step {step}, {metric} {value:.4f}"
            line += f" (the best: {said})" if result.final_is_best else f"; best model ({said}) in {path}"
    return line
