"""The `s4accel` command: a thin shell over the Python API. Heavy imports happen inside the commands, so `--help`
and recipe errors answer at once."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from .errors import RecipeError, S4AccelError
from .tools.command_line import bare_fast_dev_run, bare_resume_to_latest, readable_help
from .tools.launcher import continue_command, report_to_launcher

# rich_markup_mode None: click's plain help, which rewraps each paragraph of a docstring (rich kept its line breaks,
# so descriptions looked cut mid-sentence), shows no type beside a flag (rich showed `<bool>`) and reads brackets as
# text (rich took the `[lm_eval]` of `pip install 's4accel[lm_eval]'` for markup and dropped it).
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Train S4 and mixture-of-experts sequence models with HuggingFace Accelerate.")

RecipeArg = Annotated[Path, typer.Argument(
    help="Recipe YAML file (see recipes/), or a run directory (its recipe.yaml; the run stays there).",
    show_default=False)]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="SECTION.KEY=VALUE", show_default=False,
    help="Override a recipe value (YAML-parsed), e.g. --set optim.lr=1e-3; repeatable.")]


def command(*args, **kwargs):
    """`@app.command()`, with an error a user can cause (any `S4AccelError`) printed as `error: ...` lines and the
    error's exit code, without a traceback: one place for what every command did in its own try block. Under a
    launcher every process hands the error to the launcher's failure report (which ends with it) and only the first
    prints it: an error every process meets (a refused resume) is not repeated once per process."""
    def register(function):
        @functools.wraps(function)  # typer reads the wrapped function's signature for the options
        def run(*a, **kw):
            try:
                return function(*a, **kw)
            except S4AccelError as e:
                if not report_to_launcher("\n".join(e.lines())) or os.environ.get("RANK", "0") == "0":
                    for line in e.lines():
                        typer.echo(line, err=True)
                raise typer.Exit(e.exit_code) from None
        return app.command(*args, **kwargs)(run)
    return register


ResumeOpt = Annotated[str | None, typer.Option(
    "--resume", metavar="[PATH]", show_default=False,
    help="Continue the run: alone, from the newest complete checkpoint in the run directory (starting fresh when "
         "there is none); with PATH, from that checkpoint directory.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Resume even though training-relevant recipe fields changed.")]


FastDevOpt = Annotated[int | None, typer.Option(
    "--fast-dev-run", metavar="[N]", show_default=False,
    help="Check the whole run end to end first (Lightning's fast_dev_run): N optimizer steps (alone: 1), an "
         "evaluation of N validation batches, a checkpoint and the export, in a scratch directory deleted once they "
         "pass; no trackers, no Hub push.")]


@command()
def train(recipe: RecipeArg, overrides: SetOpt = None, resume: ResumeOpt = None, force: ForceOpt = False,
          fast_dev_run: FastDevOpt = None):
    """Train the model a recipe describes. Multi-process: accelerate launch -m s4accel train RECIPE.

    Every recipe key, with its type, default and meaning: docs/reference/recipe.md (`s4accel show RECIPE` prints a
    recipe with its defaults filled in)."""
    from .allocator import keep_freed_memory
    from .config import load_recipe

    keep_freed_memory()  # reuse each step's freed activations instead of faulting them in again (glibc)

    resolved = load_recipe(recipe, overrides or [])
    from .tools.run import train as run_training

    started = time.perf_counter()
    try:
        result = run_training(resolved, resume=resume, force=force, fast_dev_run=fast_dev_run)
    except KeyboardInterrupt:  # a second Ctrl-C, or a SIGTERM well after the first: stopped where it was
        if os.environ.get("RANK", "0") == "0":
            from .training.runs.checkpoint import latest_complete

            kept = latest_complete(resolved.run.dir) if resolved.run.dir.is_dir() else None
            command, on = continue_command(resolved.run.dir)
            where = f"last complete checkpoint {kept}; continue with{on}: {command}" if kept else \
                "no checkpoint had been written"
            typer.echo(f"second signal: stopped at once without saving; {where}", err=True)
        raise typer.Exit(130) from None
    if not result.is_main_process:
        return
    from .tools.run import result_line
    from .training.evaluate import headline
    from .training.observe.console import append_to_log

    if fast_dev_run is not None:
        from .tools.fast_dev_run import passed_line

        typer.echo(f"fast dev run stopped at step {result.steps} ({result.stop_reason})" if result.preempted else
                   passed_line(result, time.perf_counter() - started, headline(result.eval_metrics)))
        return
    line = result_line(result)
    typer.echo(line)
    append_to_log(result.run_dir, line)


@command()
def show(recipe: RecipeArg, overrides: SetOpt = None,
         depth: Annotated[int, typer.Option("--depth", min=0, help="Levels of the per-layer summary (0: none).")] = 2):
    """Print the resolved recipe, a per-layer summary, the model's parameter count and the optimizer's parameter
    groups, without training."""
    from .config import load_recipe
    from .tools.summary import describe, layer_table, optimizer_line, summary_model

    resolved = load_recipe(recipe, overrides or [])
    task, model, note = summary_model(resolved)
    optimizer = optimizer_line(resolved, task, model)  # an error here is the command's one line, before any output
    typer.echo(resolved.to_yaml(), nl=False)
    for line in layer_table(model, depth) if depth else []:
        typer.echo(line)
    typer.echo(describe(resolved, task, model))
    typer.echo(optimizer)
    if note:
        typer.echo(note)


ModelArg = Annotated[str, typer.Argument(
    help="A model directory, a run directory (its final/ model) or a Hub repo id (owner/name).", show_default=False)]


@command()
def generate(
    model: ModelArg,
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.", show_default=False)],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 200,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0: greedy.")] = 0.8,
    top_p: Annotated[float | None, typer.Option("--top-p", min=0.0, max=1.0, show_default=False)] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=1, show_default=False)] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
):
    """Continue a prompt with a trained language model (safetensors weights only, no remote code)."""
    from .tools.inference import generate_text
    from .training.observe.console import quiet_libraries

    quiet_libraries(progress_bars=False)  # the result is what counts; the command's own bar stays

    text = generate_text(model, prompt, max_new_tokens, temperature, top_p, top_k, seed)
    typer.echo(text)


@command("eval")
def eval_(
    model: ModelArg,
    recipe: Annotated[Path | None, typer.Argument(
        help="Recipe YAML file or run directory whose task scores the model (not with --lm-eval).",
        show_default=False)] = None,
    overrides: SetOpt = None,
    data: Annotated[Path | None, typer.Option("--data", help="Score this file or folder instead of the recipe's "
                                              "evaluation split (same kind and columns).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as one JSON object.")] = False,
    lm_eval: Annotated[str | None, typer.Option(
        "--lm-eval", metavar="TASK[,TASK...]", show_default=False,
        help="Score a language model on lm-evaluation-harness tasks instead (pip install 's4accel[lm_eval]').")] \
        = None,
    include_path: Annotated[Path | None, typer.Option(
        "--include-path", help="A folder of lm-eval task YAMLs (with --lm-eval). A task folder is code: its YAMLs can "
        "name Python functions (!function), which run.", show_default=False)] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many documents per lm-eval task.",
                                              show_default=False)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="lm-eval's batch size.")] = 8,
):
    """Evaluate a saved or Hub model on a recipe's whole evaluation split (or --data) with its task's metrics, or a
    language model on lm-evaluation-harness tasks (--lm-eval)."""
    from .training.observe.console import quiet_libraries

    quiet_libraries(progress_bars=False)  # the result is what counts; the command's own bar stays

    if (recipe is None) == (lm_eval is None):
        raise RecipeError("eval: give a RECIPE (its task scores the model) or --lm-eval TASKS, one of the two")
    if lm_eval is not None:
        if overrides or data is not None:
            raise RecipeError("eval: --set and --data go with a RECIPE, not with --lm-eval")
        return _lm_eval(model, lm_eval, include_path, limit, batch_size, as_json)
    from .config import load_recipe
    from .tools.inference import evaluate_model

    metrics = evaluate_model(model, load_recipe(recipe, overrides or []), data=data)
    if as_json:
        typer.echo(json.dumps(metrics))
        return
    from .training.evaluate import loggable

    shown = loggable(metrics)  # a confusion matrix as a table
    width = max(len(k) for k, v in shown.items() if not isinstance(v, str))
    for key, value in shown.items():
        typer.echo(f"{key}:\n{value}" if isinstance(value, str) else f"{key:<{width}}  {value:.4f}")


def _lm_eval(model: str, tasks: str, include_path: Path | None, limit: int | None, batch_size: int, as_json: bool):
    """`eval --lm-eval`: lm-eval's results table, or `{task: {metric: value}}` as JSON (lm-eval's metric keys
    without their `,none` filter suffix)."""
    from .tools.harness import lm_eval_model

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    out = lm_eval_model(model, names, include_path=include_path, limit=limit, batch_size=batch_size)
    if as_json:
        typer.echo(json.dumps({task: {k.removesuffix(",none"): float(v) for k, v in metrics.items()
                                      if isinstance(v, (int, float))} for task, metrics in out["results"].items()}))
        return
    from lm_eval.utils import make_table

    typer.echo(make_table(out))


@command()
def predict(
    model: ModelArg,
    data: Annotated[Path, typer.Argument(help="A data file or folder (any kind the data section reads), or a recipe "
                                         "(.yaml: its evaluation split).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Where the predictions go: .csv or .jsonl.", show_default=False)],
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 16,
    keep: Annotated[str, typer.Option("--keep", help="Input columns to copy into each output row, comma-separated "
                                      "(e.g. id,label): score the predictions without a join.")] = "",
):
    """Predict every example of DATA with a trained model: labels and probabilities, values, or per-document loss."""
    from .errors import DataError
    from .tools.predict import predict as run_predict
    from .training.observe.console import quiet_libraries

    quiet_libraries(progress_bars=False)  # the result is what counts; the command's own bar stays

    columns = tuple(c.strip() for c in keep.split(",")) if keep else ()
    if "" in columns:
        raise DataError(f"--keep {keep!r}: expected column names separated by commas (e.g. id,label)")
    path = run_predict(model, data, out, batch_size=batch_size, keep=columns)
    if path is not None:
        typer.echo(f"predictions written to {path}")


@command()
def push(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (runs/<name>).", show_default=False)],
    repo_id: Annotated[str, typer.Option("--repo-id", help="owner/name on the Hub.", show_default=False)],
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    revision: Annotated[str | None, typer.Option("--revision", help="Branch (created if missing).",
                                                 show_default=False)] = None,
    best: Annotated[bool, typer.Option("--best", help="The best model kept by checkpoint.keep_best.")] = False,
    final: Annotated[bool, typer.Option("--final", help="The final model (the default).")] = False,
    ema: Annotated[bool, typer.Option("--ema", help="The EMA weights (train.ema).")] = False,
):
    """Upload a run's model to the Hub with a model card, recipe, metrics and TensorBoard logs."""
    from .tools.hub import push_run

    if best + final + ema > 1:
        typer.echo("error: choose one of --best, --final, --ema", err=True)
        raise typer.Exit(2)
    which = "best" if best else "ema" if ema else "final"
    url = push_run(run_dir, repo_id, private=private, revision=revision, which=which)
    typer.echo(f"pushed {which} model of {run_dir} to {repo_id}: {url}")


@command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (runs/<name>).", show_default=False)],
    out: Annotated[Path, typer.Argument(help="The folder to write: from_pretrained loads it.", show_default=False)],
    step: Annotated[int | None, typer.Option("--step", min=0, help="The checkpoint of this optimizer step (default: "
                                             "the newest complete one).", show_default=False)] = None,
    ema: Annotated[bool, typer.Option("--ema", help="The EMA weights of that checkpoint (train.ema).")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it holds files.")] = False,
    merge: Annotated[bool, typer.Option("--merge", help="A LoRA run (model.lora): the base with the adapter merged "
                                        "into it, a plain model (default: the adapter).")] = False,
):
    """Write the model of a training checkpoint (one process, DDP or FSDP-sharded) as a from_pretrained folder with
    its tokenizer, code and model card: any step of a run, also of one stopped before its end."""
    from .tools.export import export_checkpoint
    from .training.observe.console import quiet_libraries

    quiet_libraries(progress_bars=False)  # the result is what counts

    done = export_checkpoint(run_dir, out, step=step, ema=ema, overwrite=overwrite, merge=merge)
    for warning in done.warnings:
        typer.echo(f"warning: {warning}", err=True)
    what = f"{'EMA' if ema else 'model'}{' merged with its LoRA adapter' if merge else ''}"
    if done.kind == "final":  # a LoRA run without step checkpoints: its final/ adapter, merged
        typer.echo(f"exported the {what} of final/ to {done.out}")
    else:
        typer.echo(f"exported the {what} of step {done.step} ({done.kind} checkpoint {done.checkpoint}) to {done.out}")


@command("lr-find")
def lr_find(
    recipe: RecipeArg,
    overrides: SetOpt = None,
    min_lr: Annotated[float, typer.Option("--min-lr", min=0.0)] = 1e-7,
    max_lr: Annotated[float, typer.Option("--max-lr", min=0.0)] = 1.0,
    steps: Annotated[int, typer.Option("--steps", min=8)] = 100,
    out: Annotated[Path | None, typer.Option("--out", help="Where lr_find.png and lr_find.json go (default: "
                                             "<run_dir>/lr_find).", show_default=False)] = None,
):
    """Learning-rate range test: an exponential lr sweep on a throwaway model, the smoothed loss, a suggested lr."""
    from .config import load_recipe
    from .tools.finders import find_lr

    resolved = load_recipe(recipe, overrides or [])
    result = find_lr(resolved, min_lr, max_lr, steps, out_dir=out or resolved.run.dir / "lr_find")
    if result.plot is None:  # not the main process
        return
    why = " (stopped early: the loss diverged)" if result.stopped_early else ""
    suggestion = f"{result.suggested_lr:.3g}" if result.suggested_lr is not None else "none (too few points)"
    typer.echo(f"swept {len(result.lrs)} steps from {result.lrs[0]:.2e} to {result.lrs[-1]:.2e}{why}; suggested lr "
               f"{suggestion} (set optim.lr); plot {result.plot}")


@command()
def sweep(recipe: RecipeArg, overrides: SetOpt = None, launch_config: Annotated[Path | None, typer.Option(
        "--launch-config", metavar="FILE", show_default=False,
        help="Run each trial on the processes of this accelerate config (s4accel launch --config_file FILE).")] = None):
    """Search the hyperparameters of the recipe's sweep section (Optuna): trials trained one after another, pruned
    when they fall behind, then the best with its values as a recipe.

    The study is kept in <run dir>-sweep/study.db: the same command continues a sweep that stopped (a trial cut short
    resumes from its checkpoint), and several at once (one per GPU, CUDA_VISIBLE_DEVICES) share its trials."""
    from .tools.sweep import run_sweep

    try:
        run_sweep(recipe, overrides or [], str(launch_config) if launch_config else None, echo=typer.echo)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@command("find-batch-size")
def find_batch_size_cmd(
    recipe: RecipeArg,
    memory_mb: Annotated[float, typer.Option("--memory-mb", min=1.0, help="Memory budget of one process, MiB.",
                                             show_default=False)],
    overrides: SetOpt = None,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1)] = 1024,
):
    """The largest data.batch_size whose training step fits a memory budget (CUDA: peak allocated; CPU: peak RSS)."""
    from .config import load_recipe
    from .tools.finders import find_batch_size

    result = find_batch_size(load_recipe(recipe, overrides or []), memory_mb, max_batch)
    for b, mb in sorted(result.peak_mb.items()):
        typer.echo(f"batch {b:>5}: " + ("out of memory" if mb is None else f"{mb:,.0f} MiB"))
    if result.batch_size is None:
        typer.echo(f"error: not even batch size 1 fits in {memory_mb:,.0f} MiB on {result.device}", err=True)
        raise typer.Exit(1)
    typer.echo(f"largest batch size within {memory_mb:,.0f} MiB on {result.device}: {result.batch_size} "
               f"(set data.batch_size, with train.grad_accum for a larger effective batch)")
    if result.capped:
        typer.echo(f"note: {result.batch_size} is the --max-batch cap, not a memory limit: larger sizes were not "
                   f"tried (raise --max-batch to look further)")


@command()
def listops(
    out_dir: Annotated[Path, typer.Argument(help="Folder for basic_train.tsv, basic_val.tsv, basic_test.tsv.",
                                            show_default=False)],
    train: Annotated[int, typer.Option("--train", min=1, help="Training expressions.")] = 96_000,
    val: Annotated[int, typer.Option("--val", min=1, help="Validation expressions.")] = 2_000,
    test: Annotated[int, typer.Option("--test", min=1, help="Test expressions.")] = 2_000,
    min_length: Annotated[int, typer.Option("--min-length", min=1, help="Fewest symbols (brackets aside).")] = 500,
    max_length: Annotated[int, typer.Option("--max-length", min=1, help="Most symbols (brackets aside).")] = 2_000,
    max_depth: Annotated[int, typer.Option("--max-depth", min=1, help="Tree depth: operators nest at most one "
                                           "less deep.")] = 10,
    max_args: Annotated[int, typer.Option("--max-args", min=2, help="Most arguments of an operator.")] = 10,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the files of a release already in "
                                            "OUT_DIR.")] = False,
):
    """Generate ListOps as the Long Range Arena paper did, in its release's format (read by data.source:
    lra_listops). The defaults are the paper's."""
    from .tools.listops import write_listops

    lengths = write_listops(out_dir, train, val, test, min_length, max_length, max_depth, max_args, seed,
                            overwrite)
    every = [n for split in lengths.values() for n in split]
    typer.echo(f"wrote {train:,} / {val:,} / {test:,} expressions to {out_dir} (symbols per expression: "
               f"{min(every)} to {max(every)}, mean {sum(every) / len(every):.0f})")


@command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(ctx: typer.Context):
    """Run a command on several processes with accelerate launch's launcher: s4accel launch --config_file CONFIG
    train RECIPE.

    accelerate launch's options (accelerate launch --help) come first, then the command and its arguments as after
    `s4accel`. The same launcher as accelerate launch -m s4accel, but a run stopped by Ctrl-C or SIGTERM ends with
    its own line (where it stopped, how to continue), not the launcher's traceback, and a failed process is one
    line."""
    from .tools.launcher import launch as launch_command

    if not ctx.args:
        typer.echo("error: s4accel launch [ACCELERATE LAUNCH OPTIONS] COMMAND ...: name the command, e.g. "
                   "s4accel launch --config_file accelerate_configs/cpu_2proc.yaml train recipes/quickstart.yaml",
                   err=True)
        raise typer.Exit(2)
    raise typer.Exit(launch_command(ctx.args))


@command()
def models():
    """List the named model sizes a recipe's model.name can take."""
    from .config.sizes import MODEL_SIZES

    for name, spec in MODEL_SIZES.items():
        fields = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "family")
        typer.echo(f"{name:<10} {spec['family']:<4} {fields}")


def main(argv: list[str] | None = None):
    command = readable_help(typer.main.get_command(app))
    argv = sys.argv[1:] if argv is None else argv
    command(args=bare_fast_dev_run(bare_resume_to_latest(argv)), prog_name="s4accel")
