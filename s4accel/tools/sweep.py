"""`s4accel sweep RECIPE`: a hyperparameter search over the recipe's `sweep.params` (transformers.Trainer's
`hyperparameter_search`), Optuna choosing the values (TPE, random or a grid) and pruning trials that fall behind.

Each trial is a whole `s4accel train` run of the recipe with its values (`--set`), in its own directory
(`<run dir>-sweep/trial_0007/`, a run like any other: checkpoints, final/, metrics), started as a command of its own,
through `s4accel launch --config_file` when the sweep is given one: the processes of a trial start and end with it.
A callback reports its evaluations to the study (sweep_report.py). The study lives in `<run dir>-sweep/study.db`
(SQLite), so nothing is lost when the sweep stops: the same command continues it, and a trial cut short by Ctrl-C,
SIGTERM or a lost machine resumes from its last checkpoint first. Several sweep commands at once share the study.
Hand-written around Optuna's ask-and-tell interface because each trial is a process of its own, which Optuna's
`optimize` (an objective function called in this process) does not start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import shlex
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..config import Recipe, load_recipe
from ..config.sweep_sections import SweepCfg, SweepRange
from ..errors import RecipeError
from ..training.runs.checkpoint import latest_complete
from ..training.runs.preemption import sigterm_when_the_launcher_dies
from .sweep_report import pruner_for

HEARTBEAT_S = 60
"""How often a running trial tells the study it is alive; one silent for 3 x this long was lost (its machine went
away with the sweep) and is resumed by the next sweep command."""


def sweep_dir(recipe: Recipe) -> Path:
    """`runs/x-sweep` for the run directory `runs/x` (a relative path stays one: the trials run where the sweep
    does)."""
    run_dir = recipe.run.dir
    return run_dir.with_name(f"{run_dir.absolute().name}-sweep")


def check_sweep(recipe_path: Path, overrides: list[str], recipe: Recipe) -> SweepCfg:
    """Before the first trial: the recipe has a sweep; every value it names (a range's ends) is one the recipe
    takes, validated as the trial will be; the metric is one the task reports."""
    cfg = recipe.sweep
    if cfg is None:
        raise RecipeError(f"{recipe_path}: no sweep section: add one, e.g. sweep: {{trials: 20, params: {{optim.lr: "
                          f"{{low: 1.0e-4, high: 1.0e-2, log: true}}}}}}")
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise RecipeError("s4accel sweep needs optuna, which is not installed: pip install 's4accel[sweep]'") \
            from None
    for key, space in cfg.params.items():
        for value in space.corners() if isinstance(space, SweepRange) else space:
            try:
                load_recipe(recipe_path, [*overrides, f"{key}={json.dumps(value)}"])
            except RecipeError as e:
                said = str(e).splitlines()[0].removeprefix(f"{recipe_path}: ")
                raise RecipeError(f"{recipe_path}: sweep.params.{key}: the value {value!r} is not one the recipe "
                                  f"takes: {said}") from None
    from ..training.task import load_task

    load_task(recipe)  # sweep.metric among the metrics the task reports
    return cfg


@dataclass
class Outcome:
    number: int
    values: dict
    state: str
    """complete, pruned, failed or stopped."""
    value: float | None = None
    note: str = ""


def run_sweep(recipe_path: str | Path, overrides: list[str] | tuple[str, ...] = (), launch_config: str | None = None,
              echo=print) -> list[Outcome]:
    """Run trials until the study has `sweep.trials` (complete, pruned or failed); each finished one is one line
    through `echo`, then the best. Returns this command's trials."""
    with warnings.catch_warnings():
        # Optuna marks the heartbeat experimental, and warns that it is meant for `optimize`: here the sweep beats
        # for each trial's process itself (run_trial)
        warnings.filterwarnings("ignore", message=".*(experimental|Heartbeat of storage)")
        recipe_path = Path(recipe_path)
        if recipe_path.is_dir() and (recipe_path / "recipe.yaml").is_file():  # a run directory: its recipe, as a
            recipe_path = recipe_path / "recipe.yaml"  # file (a run directory would keep every trial in it)
        return _run_sweep(recipe_path, list(overrides), launch_config, echo)


def _run_sweep(recipe_path: Path, overrides: list[str], launch_config: str | None, echo) -> list[Outcome]:
    recipe = load_recipe(recipe_path, overrides)
    cfg = check_sweep(recipe_path, overrides, recipe)
    home = sweep_dir(recipe)
    home.mkdir(parents=True, exist_ok=True)
    study, storage = open_study(home, recipe, cfg)
    grid = [{k: json.dumps(v) for k, v in combo.items()} for combo in cfg.grid()] if cfg.sampler == "grid" else []
    total = min(cfg.trials, len(grid)) if grid else cfg.trials
    outcomes = []
    while True:
        with study_lock(home):  # another sweep sharing the study takes its trial, values set, before or after
            trial = take_trial(study, cfg, grid, total)
            if trial is None:
                break
            study.sampler = sampler_for(cfg, recipe, trial.number)  # Optuna samples at suggest_*, with study.sampler
            values = {key: suggest(trial, key, space) for key, space in cfg.params.items()}
        run_dir = Path(trial.user_attrs.get("run_dir", home / f"trial_{trial.number:04d}"))
        trial.set_user_attr("run_dir", str(run_dir))
        command = trial_command(recipe_path, overrides, values, run_dir, recipe, storage.url, trial, cfg,
                                launch_config, resume="continues" in trial.user_attrs)
        again = f" (trial {trial.user_attrs['continues']} resumed)" if "continues" in trial.user_attrs else ""
        echo(f"trial {trial.number}{again}: {described(values)}; training in {run_dir}")
        outcome = run_trial(study, storage, trial, command, values, cfg, run_dir)
        outcomes.append(outcome)
        echo(outcome_line(outcome, cfg, run_dir))
        if outcome.state == "stopped":
            echo(f"sweep stopped; trial {trial.number} has a checkpoint in {run_dir}: the same command continues "
                 f"the sweep, with that trial first")
            raise KeyboardInterrupt
    echo(best_line(study, cfg, recipe_path, overrides, home))
    return outcomes


def take_trial(study, cfg: SweepCfg, grid: list[dict], total: int):
    """The study's next trial for this sweep command (asked, so RUNNING for every other command), or None when the
    study has its `total`: a stopped trial with a checkpoint is continued first, then the next grid combination no
    counted trial has (in the order written), or the sampler's next values."""
    import optuna
    from optuna.trial import TrialState

    optuna.storages.fail_stale_trials(study)  # a trial whose sweep died: failed, then continued below
    trials = study.get_trials(deepcopy=False)
    continued = {t.user_attrs.get("continues") for t in trials}
    resumable = [t for t in trials if t.state == TrialState.FAIL and "error" not in t.user_attrs
                 and t.number not in continued and has_checkpoint(t.user_attrs.get("run_dir"))]
    # a trial stopped and resumed is counted once, as its continuation; one stopped before its first checkpoint is
    # not counted (another takes its place)
    counted = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
               or (t.state == TrialState.FAIL and "error" in t.user_attrs)]
    if resumable:
        old = resumable[0]
        study.enqueue_trial(old.params, user_attrs={"continues": old.number, "run_dir": old.user_attrs["run_dir"]})
    elif len(counted) >= total:
        return None
    elif cfg.sampler == "grid":
        todo = [p for p in grid if p not in [t.params for t in counted]]
        if not todo:
            return None
        study.enqueue_trial(todo[0])
    return study.ask()


@contextlib.contextmanager
def study_lock(home: Path):
    """Held while a sweep command opens the study (creating its tables: two at once collide) and while it reads the
    study and takes its next trial, so that two commands sharing the study (one per GPU) never both take the last of
    `sweep.trials`, one grid combination, or one stopped trial to continue: an advisory lock (`flock`) on
    `study.lock` beside the study, as the SQLite file is, on one machine's disk."""
    with open(home / "study.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def open_study(home: Path, recipe: Recipe, cfg: SweepCfg):
    """The study in `home/study.db`, created or continued: under the study's lock, since of several sweeps started
    at once on a new study, two creating its tables collide (an IntegrityError from the schema's migration)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = sampler_for(cfg, recipe, 0)
    pruner = pruner_for(cfg.prune.model_dump() if cfg.prune else None)
    direction = "minimize" if cfg.mode == "min" else "maximize"
    try:
        with study_lock(home):
            storage = optuna.storages.RDBStorage(f"sqlite:///{home / 'study.db'}", heartbeat_interval=HEARTBEAT_S,
                                                 grace_period=3 * HEARTBEAT_S)
            study = optuna.create_study(study_name=recipe.run.name, storage=storage, sampler=sampler,
                                        pruner=pruner, direction=direction, load_if_exists=True)
    except ValueError as e:  # an existing study of the other direction
        raise RecipeError(f"sweep.mode: {home / 'study.db'} holds a study that does not {direction} "
                          f"({e}); give this sweep another run.name or run.out_dir") from None
    if study.direction.name.lower() != direction:
        raise RecipeError(f"sweep.mode: {cfg.mode}, but the study in {home / 'study.db'} was run to "
                          f"{study.direction.name.lower()}; give this sweep another run.name or run.out_dir")
    return study, storage


def sampler_for(cfg: SweepCfg, recipe: Recipe, number: int):
    """The sampler of trial `number`, seeded by the sweep's seed and the number: the same study samples the same
    values again, and two sweep commands sharing a study do not sample the same values for their next trials (one
    seeded sampler in each would)."""
    import optuna

    seed = (cfg.seed if cfg.seed is not None else recipe.run.seed) + 100_003 * number
    if cfg.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)  # a grid: each combination is queued, then taken as it is


def suggest(trial, key: str, space):
    """The trial's value for `key`: lists are offered as their values' JSON text (Optuna's choices are plain
    scalars; a list may hold mappings), ranges as Optuna's int or float distributions."""
    if isinstance(space, list):
        return json.loads(trial.suggest_categorical(key, [json.dumps(v) for v in space]))
    if space.integer:
        return trial.suggest_int(key, space.low, space.high, step=space.step or 1, log=space.log)
    return trial.suggest_float(key, space.low, space.high, step=space.step, log=space.log)


def trial_command(recipe_path: Path, overrides: list[str], values: dict, run_dir: Path, recipe: Recipe,
                  storage_url: str, trial, cfg: SweepCfg, launch_config: str | None, resume: bool) -> list[str]:
    reporter = {"target": "s4accel.tools.sweep_report:ReportToStudy",
                # (Optuna's trial id: the study's row of this trial, which the callback reports to)
                "args": {"storage": storage_url, "study": recipe.run.name, "trial_id": trial._trial_id,
                         "metric": cfg.metric, "prune": cfg.prune.model_dump() if cfg.prune else None}}
    callbacks = [c.model_dump() for c in recipe.callbacks] + [reporter]
    items = [*overrides, *(f"{k}={json.dumps(v)}" for k, v in values.items()), f"run.out_dir={run_dir}",
             f"callbacks={json.dumps(callbacks)}", "log.progress_bar=false"]
    launch = ["launch", "--config_file", str(Path(launch_config).absolute())] if launch_config else []
    command = [sys.executable, "-m", "s4accel", *launch, "train", str(recipe_path.absolute())]
    for item in items:
        command += ["--set", item]
    return command + (["--resume"] if resume else [])


def run_trial(study, storage, trial, command: list[str], values: dict, cfg: SweepCfg, run_dir: Path) -> Outcome:
    """The trial's command to its end, the study told how it went. Ctrl-C or SIGTERM reaches the trial's processes
    too (SIGTERM is passed on): they save a checkpoint, and the trial is left to be resumed."""
    from optuna.trial import TrialState

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # (SIGTERM to the trial when the sweep dies, even by SIGKILL: it saves a checkpoint instead of training on
        # unwatched; the study then fails the silent trial and the next sweep resumes it)
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, preexec_fn=sigterm_when_the_launcher_dies)
        storage.record_heartbeat(trial._trial_id)
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        stopped = False
        try:
            while True:
                try:
                    proc.wait(timeout=HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    storage.record_heartbeat(trial._trial_id)
        except KeyboardInterrupt:
            stopped = True
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # Ctrl-C reached it already; a SIGTERM to the sweep did not
            proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
        out.seek(0)
        err.seek(0)
        last_out, error = last_line(out.read()), last_line(err.read())
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    if stopped or last_out.startswith("stopped at step"):
        note = last_out.split(";")[0] if last_out.startswith("stopped at step") else "interrupted"
        trial.set_user_attr("stopped", note)
        study.tell(trial, state=TrialState.FAIL)
        return Outcome(trial.number, values, "stopped", note=note)
    if proc.returncode != 0:
        trial.set_user_attr("error", error or f"exit code {proc.returncode}")
        study.tell(trial, state=TrialState.FAIL)
        return Outcome(trial.number, values, "failed", note=error or f"exit code {proc.returncode}")
    step = frozen.user_attrs.get("last_eval_step")
    value = frozen.intermediate_values.get(step) if step is not None else None
    if value is None or not math.isfinite(value):
        why = f"its last evaluation's {cfg.metric} is not finite" if step is not None else "it never evaluated"
        trial.set_user_attr("error", why)
        study.tell(trial, state=TrialState.FAIL)
        return Outcome(trial.number, values, "failed", note=why)
    if "pruned_at" in frozen.user_attrs:
        study.tell(trial, state=TrialState.PRUNED)
        return Outcome(trial.number, values, "pruned", value, f"at step {frozen.user_attrs['pruned_at']}")
    study.tell(trial, value)
    return Outcome(trial.number, values, "complete", value)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def has_checkpoint(run_dir: str | None) -> bool:
    """Whether `--resume` would find a complete checkpoint there (a half-written one does not count)."""
    return run_dir is not None and Path(run_dir).is_dir() and latest_complete(Path(run_dir)) is not None


def described(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in values.items())


def outcome_line(o: Outcome, cfg: SweepCfg, run_dir: Path) -> str:
    head = f"trial {o.number}: {described(o.values)}"
    if o.state == "complete":
        return f"{head} -> {cfg.metric} {o.value:.4f}"
    if o.state == "pruned":
        return f"{head} -> pruned {o.note} ({cfg.metric} {o.value:.4f})"
    if o.state == "failed":
        return f"{head} -> failed: {o.note} (its log: {run_dir / 'train.log'})"
    return f"{head} -> {o.note}"


def best_line(study, cfg: SweepCfg, recipe_path: Path, overrides: list[str], home: Path) -> str:
    """The best trial so far, and its values written as a recipe to train with (`best.yaml`, beside the study)."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        return f"no trial completed; the study is {home / 'study.db'}"
    best = study.best_trial
    values = {k: json.loads(v) if isinstance(cfg.params.get(k), list) else v for k, v in best.params.items()}
    tuned = load_recipe(recipe_path, [*overrides, *(f"{k}={json.dumps(v)}" for k, v in values.items())])
    data = tuned.to_dict()
    data.pop("sweep", None)
    (home / "best.yaml").write_text(Recipe.model_validate(data).to_yaml())
    return (f"best of {len(done)} complete trial(s): trial {best.number}, {cfg.metric} {best.value:.4f} with "
            f"{described(values)}; its model: {Path(best.user_attrs['run_dir']) / 'final'}; the recipe with these "
            f"values: {home / 'best.yaml'} (s4accel train {shlex.quote(str(home / 'best.yaml'))})")
