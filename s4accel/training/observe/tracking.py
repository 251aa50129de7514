"""Trackers through Accelerate: TensorBoard (`<run_dir>/tensorboard`) and a JSONL file (`<run_dir>/metrics.jsonl`)
by default, any of Accelerate's trackers by name (`wandb`, `mlflow`, ...), or your own `GeneralTracker` by import
path (`mypkg.trackers:MyTracker`).

All log from the main process only and always at `step=<optimizer step>`, for training and evaluation alike. Each
runs inside a `GuardedTracker`: a tracker that fails to start or to log never stops training. A failing call is
retried with exponential backoff; if it still fails, the tracker is disabled with one warning and the run goes on
with the others. A tracker that cannot be built at all (its package not installed) is a recipe error before any
compute (`check_tracker_packages`).

A resumed run continues the same tracker run: the run's id (kept in its checkpoints) is W&B's run `id` (with
`resume="allow"`), an MLflow run's `s4accel.run_id` tag (the run carrying it is started again by its MLflow id), and
part of trackio's run name (with `resume="allow"`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from accelerate.tracking import (LOGGER_TYPE_TO_CLASS, GeneralTracker, MLflowTracker, TensorBoardTracker,
                                 get_available_trackers, on_main_process)

from ...config import flatten
from ...errors import RecipeError
from .guarded import GuardedTracker


class JSONLTracker(GeneralTracker):
    """One JSON object per `log` call: `{"step": 10, "train/loss": 2.3, ...}`; easy to read back in tests and plots."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | Path, resume_step: int | None = None):
        super().__init__()
        self.path = Path(logging_dir) / "metrics.jsonl"
        self.resume_step = resume_step
        self.file = None

    @on_main_process
    def start(self):
        if self.resume_step is not None and self.path.exists():
            # Records the run logged after its checkpoint are logged again by the resumed run: drop the old ones.
            kept = [line for line in self.path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line).get("step", 0) <= self.resume_step]
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, self.path)
        self.file = self.path.open("a")

    @property
    def tracker(self):
        return self.file

    @on_main_process
    def store_init_configuration(self, values: dict):
        pass  # the resolved recipe is already in <run_dir>/recipe.yaml

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()

    @on_main_process
    def finish(self):
        if self.file is not None:
            self.file.close()


class FastTensorBoardTracker(TensorBoardTracker):
    """Accelerate's TensorBoard tracker spends ~1 ms per `log` call on our CPU machines (one event proto per scalar,
    then a flush of the event file): 3% of a 3 ms step at log_every=10. This one writes all scalars of a call as one
    event (one summary value per tag, which TensorBoard reads exactly like separate events) and leaves flushing to
    the writer's own thread (every `flush_secs`) and to `finish`. metrics.jsonl, flushed at every call, is the
    record that survives a kill."""

    def __init__(self, run_name: str, logging_dir: str | Path, flush_secs: int = 10, resume_step: int | None = None):
        # purge_step: TensorBoard hides the events a resumed run logged after its checkpoint (they are logged again)
        super().__init__(run_name, logging_dir, flush_secs=flush_secs,
                         purge_step=None if resume_step is None else resume_step + 1)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        from tensorboard.compat.proto.summary_pb2 import Summary  # loaded with the tracker, not with the package

        scalars = [Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items() if not isinstance(v, str)]
        self.writer.file_writer.add_summary(Summary(value=scalars), global_step=step)
        for k, v in values.items():
            if isinstance(v, str):
                self.writer.add_text(k, v, global_step=step)


class ResumedMLflowTracker(MLflowTracker):
    """Accelerate's MLflow tracker for a run that may be resumed: MLflow refuses to change a logged parameter, and a
    resumed run's recipe differs from the first start's at least in a callback or an override, which made every
    resume drop MLflow. It logs the parameters its MLflow run does not have yet; recipe.yaml has the rest."""

    def __init__(self, experiment_name: str | None = None, *args, **kwargs):
        super().__init__(experiment_name, *args, **kwargs)
        if experiment_name:  # Accelerate lets MLFLOW_EXPERIMENT_NAME replace a name given here: the recipe's wins
            self.experiment_name = experiment_name

    @on_main_process
    def store_init_configuration(self, values: dict):
        import mlflow

        logged = mlflow.get_run(self.active_run.info.run_id).data.params
        super().store_init_configuration({k: v for k, v in values.items() if k not in logged})


def tracker_config(recipe: dict) -> dict:
    """The hyperparameters trackers are started with: the recipe flattened (`optim.lr`), None as "null" (TensorBoard's
    hparams take no None)."""
    return {k: "null" if v is None else v for k, v in flatten(recipe).items()}


def tracker_class(name: str) -> type[GeneralTracker]:
    """One of Accelerate's trackers by name, or a `GeneralTracker` subclass by import path (`module:Class`)."""
    if ":" not in name:
        return LOGGER_TYPE_TO_CLASS[name]
    module, _, attr = name.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_tracker_packages(log_cfg) -> None:
    """Every tracker of `log.log_with` can be built here: a tracker whose package is not installed (or a
    `module:Class` that does not import) is known before any compute, and a run that would track nothing is refused.
    (A tracker that fails once the run is under way never stops it: `GuardedTracker`.)"""
    available = {t.value for t in get_available_trackers()}
    for name in log_cfg.log_with:
        if name == "jsonl" or name in available:
            continue
        if ":" not in name:  # an Accelerate tracker: the pip package is named like the tracker
            raise RecipeError(f"log.log_with: {name} is not installed here (pip install {name}); install it or "
                              f"remove {name} from log.log_with")
        try:
            tracker_class(name)
        except (ImportError, AttributeError) as e:
            detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise RecipeError(f"log.log_with: {name} cannot be imported ({type(e).__name__}: {detail})") from None


def check_tracker_stores(log_cfg) -> None:
    """Where MLflow and trackio will write, checked before any compute: a store they cannot use would otherwise only
    disable them (with a warning) once the run is under way, and the run would track nothing there."""
    if "mlflow" in log_cfg.log_with:
        import mlflow
        from mlflow import environment_variables as mlflow_env

        uri = mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI, or MLflow's default; reading it creates nothing
        scheme = urllib.parse.urlparse(uri).scheme
        if scheme in ("", "file"):
            if hasattr(mlflow_env, "MLFLOW_ALLOW_FILE_STORE") and not mlflow_env.MLFLOW_ALLOW_FILE_STORE.get():
                raise RecipeError(f"log.log_with: mlflow refuses its file store {uri} unless MLFLOW_ALLOW_FILE_STORE="
                                  f"true is set (MLflow 3); set it, or point MLFLOW_TRACKING_URI at a database "
                                  f"(sqlite:///mlflow.db) or a tracking server")
            _writable("mlflow", urllib.request.url2pathname(urllib.parse.urlparse(uri).path) if scheme else uri,
                      "MLFLOW_TRACKING_URI")
        elif scheme == "sqlite":
            _writable("mlflow", os.path.dirname(uri.removeprefix("sqlite:///")) or ".", "MLFLOW_TRACKING_URI")
    if "trackio" in log_cfg.log_with:
        from trackio import utils as trackio_utils

        _writable("trackio", str(trackio_utils.TRACKIO_DIR), "TRACKIO_DIR")


def _writable(name: str, folder: str, variable: str) -> None:
    """`folder` exists and can be written, or can be made: its nearest existing parent is a folder one can write."""
    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"log.log_with: {name} cannot write its store {path} ({existing} is "
                          f"{'not a folder' if not existing.is_dir() else 'not writable'}); set {variable} to a "
                          f"folder it can write")


def check_tracker_kwargs(log_cfg) -> None:
    """`log.tracker_kwargs` checked against each tracker's constructor before training starts: a misspelt argument
    would otherwise only disable the tracker (with a warning) once the run is under way. Trackers that pass their
    arguments on (`**kwargs`, e.g. to `wandb.init`) are checked by their own package when they start."""

    own = {"tensorboard": FastTensorBoardTracker, "jsonl": JSONLTracker}
    for name, kwargs in log_cfg.tracker_kwargs.items():
        try:
            cls = own.get(name) or tracker_class(name)
        except (ImportError, AttributeError, KeyError):
            continue  # reported by the tracker's guard when it starts, without stopping training
        params = inspect.signature(cls.__init__).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        allowed = [p for p in params if p not in ("self", "run_name", "logging_dir", "resume_step")]
        for key in kwargs:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise RecipeError(f"log.tracker_kwargs.{name}: unknown argument {key!r}{hint}; "
                                  f"{name} takes {', '.join(allowed) or 'no arguments'}")


PROJECT = {"wandb": ("project", "WANDB_PROJECT"), "trackio": ("project", None), "swanlab": ("project", None),
           "comet_ml": ("project_name", "COMET_PROJECT_NAME"), "clearml": ("project_name", "CLEARML_PROJECT"),
           "mlflow": ("experiment_name", "MLFLOW_EXPERIMENT_NAME")}
"""Trackers that group runs: the keyword of their own API that names the group, and the environment variable they
read it from. Accelerate passes its first argument as the group (its `project_name`), so without this every run was a
project of its own and `WANDB_PROJECT` went unread; the same keyword in `log.tracker_kwargs` collided with it."""

RUN_NAME = {"wandb": "name", "mlflow": "run_name", "swanlab": "experiment_name"}
"""The keyword under which those trackers take the run's own name (`run.name`)."""


def build_trackers(names: list[str], run_name: str, run_dir: Path, resume_step: int | None = None,
                   kwargs: dict[str, dict] | None = None, retries: int = 3, backoff_s: float = 0.5,
                   project: str | None = None, timeout_s: float = 120.0) -> list[GeneralTracker]:
    """The trackers a recipe names, each guarded, and JSON Lines with any of them (the card's curve reads it);
    `resume_step` when resuming from a checkpoint of that step; `kwargs[name]`: extra constructor arguments (e.g.
    `{"wandb": {"entity": "me"}}`); `project`: the group of runs (`log.project`)."""
    kwargs = kwargs or {}
    names = [*names, *(["jsonl"] if names and "jsonl" not in names else [])]  # `[]`: no trackers at all

    def maker(name: str) -> Callable[[str | None], GeneralTracker]:
        extra = dict(kwargs.get(name, {}))
        if name == "tensorboard":
            return lambda run_id: FastTensorBoardTracker("tensorboard", run_dir, resume_step=resume_step, **extra)
        if name == "jsonl":
            return lambda run_id: JSONLTracker(run_name, run_dir, resume_step=resume_step)
        keyword, variable = PROJECT.get(name, (None, None))
        group = extra.pop(keyword, None) or project or (variable and os.environ.get(variable)) or run_name
        if name in RUN_NAME:
            extra.setdefault(RUN_NAME[name], run_name)

        def make(run_id: str | None):  # Accelerate's own convention: (project name[, logging dir], **kwargs)
            cls = ResumedMLflowTracker if name == "mlflow" else tracker_class(name)
            own = {**same_run(name, run_id, run_name, run_dir), **extra}
            first = group if keyword else run_name
            if getattr(cls, "requires_logging_directory", False):
                return cls(first, str(run_dir), **own)
            return cls(first, **own)

        return make

    return [GuardedTracker(name, maker(name), retries, backoff_s, timeout_s=timeout_s) for name in names]


RUN_ID_TAG = "s4accel.run_id"


def same_run(name: str, run_id: str | None, run_name: str, run_dir: Path) -> dict:
    """Constructor arguments of Accelerate's `name` tracker that continue the tracker run of `run_id` when there is
    one (a resume) and start it otherwise; a recipe's `log.tracker_kwargs` override them."""
    if run_id is None:
        return {}
    if name == "wandb":  # W&B's own files go into the run directory, not the working directory
        return {"id": run_id, "resume": "allow", "dir": str(run_dir)}
    if name == "trackio":
        return {"name": f"{run_name}-{run_id[:8]}", "resume": "allow"}
    if name == "mlflow":  # MLflow makes its own run ids: the run is found by its tag
        import mlflow

        found = mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'",
                                   output_format="list", max_results=1)
        return {"run_id": found[0].info.run_id} if found else {"tags": {RUN_ID_TAG: run_id}}
    return {}
