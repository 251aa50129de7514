"""The recipe sections of the training loop: train (with ema, early_stopping, state), checkpoint, callbacks, log,
hub, sample. A docstring on every field."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..errors import did_you_mean as _did_you_mean
from .base import IMPORT_TARGET
from .base import Section as _Section
from .durations import duration_seconds


class EMACfg(_Section):
    decay: float = Field(0.999, gt=0, lt=1)
    """Weight of the running average per update: ema = decay * ema + (1 - decay) * weights."""
    start_step: int = Field(0, ge=0)
    """First optimizer step whose weights enter the average."""
    every: int = Field(1, ge=1)
    """Update the average every N optimizer steps."""


class ProfileCfg(_Section):
    wait: int = Field(1, ge=0)
    """Optimizer steps run before profiling starts (the first steps pay for warm-up work a steady run does not)."""
    warmup: int = Field(1, ge=0)
    """Steps traced but discarded (the profiler's own start-up cost)."""
    active: int = Field(3, ge=1)
    """Steps recorded into the trace."""
    record_shapes: bool = False
    """Record each operator's input shapes (larger trace)."""
    profile_memory: bool = False
    """Record tensor allocations and frees."""
    with_stack: bool = False
    """Record the Python stack of each operator (much larger trace)."""


class EarlyStoppingCfg(_Section):
    metric: str = "loss"
    """Eval metric to monitor (see EVAL_METRICS)."""
    mode: Literal["min", "max"] = "min"
    """Whether a lower (`min`, a loss) or a higher (`max`, an accuracy) value is better."""
    patience: int = Field(3, ge=1)
    """Evaluations without an improvement of more than `min_delta` before stopping."""
    min_delta: float = Field(0.0, ge=0)
    """The smallest change that counts as an improvement."""
    divergence_threshold: float | None = None
    """Stop at once when the metric is worse than this (above it for `min`, below for `max`) or not finite."""


class StateCfg(_Section):
    mode: Literal["none", "tbptt", "reset", "bptt"] = "none"
    """Recurrent state across consecutive chunks of long text streams (see s4accel/training/carried_state.py): `none`
    trains on
    shuffled independent blocks; `tbptt` carries each chunk's final state (detached) into the next chunk of the same
    rows; `reset` does so but restarts from zero every `n_context + 1` chunks; `bptt` starts each chunk from the state
    of re-reading the previous `n_context` chunks without gradient. Text data only."""
    n_context: int = Field(1, ge=1)
    """Chunks of context for `reset` and `bptt`."""


class TrainCfg(_Section):
    max_steps: int | None = Field(None, ge=1)
    """Number of optimizer steps (1000 when neither this nor `max_epochs` is set). With `max_epochs` too, the run
    ends at whichever comes first."""
    max_epochs: int | None = Field(None, ge=1)
    """Passes over the training data. Worked out into optimizer steps once the data is built:
    ceil(max_epochs x batches per process and epoch / grad_accum), so every batch of the last pass is trained on (a
    window spanning the pass's end takes its missing micro-batches from the next pass). Not for a streamed source."""
    max_time: str | float | dict[str, float] | None = None
    """A training-time budget (Lightning's `max_time`): the run ends after the optimizer step during which it ran
    out, as it does at `max_steps` (a last evaluation, `final/`; the last line says why), whichever comes first.
    Counted over the training loop (steps, evaluations, checkpoints; not setup or export) and over resumes: a
    resumed run has what is left, and a larger value continues a run that spent it (`--resume --set
    train.max_time=4h`). Forms: `90m`, `1h30m`, `2d`, `HH:MM:SS`, `DD:HH:MM:SS`, SLURM's `D-HH:MM:SS`,
    `{hours: 1, minutes: 30}` or a number of seconds."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step; the loss is normalised by the real token count of the whole window."""
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None
    """Autocast dtype; `null` takes it from the accelerate config / `accelerate launch --mixed_precision`."""

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _off_is_no(cls, value):
        return "no" if value is False or value == "off" else value  # `mixed_precision: off` / `false`: none
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    """transformers.Trainer's `label_smoothing_factor`: the built-in tasks' training loss against targets mixed with
    the uniform distribution, `(1 - e) one-hot + e / classes` (classification, and each next token of a language
    model). Evaluation reports the plain negative log-likelihood (loss, perplexity, bits per byte), so runs with and
    without it compare. A task of your own reads it from `self.recipe.train.label_smoothing`."""
    clip_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value (the norm is logged either way)."""
    clip_grad_value: float | None = Field(None, gt=0)
    """Clip each gradient element to [-v, v] instead (exclusive with `clip_grad_norm`)."""
    eval_every: int | Literal["epoch"] = 200
    """Evaluate every N optimizer steps (0: only at the end), or `epoch`: after each pass over the training data (the
    step whose window finished the pass) and at the end, with `max_epochs` or `max_steps`. Not for a streamed
    source, which has no epochs."""
    eval_at_start: bool = False
    """Evaluate the model before the first step too (step 0; transformers.Trainer's `eval_on_start`), reported like
    any evaluation: where a fine-tuned model's curve starts, and evaluation shown to work before hours of training
    (with `checkpoint.keep_best`, the starting model may be the best). Not when a run resumes."""
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
    context_parallel: int = Field(1, ge=1)
    """Processes that share each sequence (S4 models): each holds a contiguous chunk of `seq_len / context_parallel`
    steps, and each layer exchanges the chunks' end states (one small collective, whatever the length), so the
    outputs, losses and gradients are those of whole sequences while each process holds a share of the activations.
    The processes of a run form groups of this size; `num_processes / context_parallel` groups train data-parallel
    (each on its own batches). Evaluation reads whole sequences, data-parallel over all processes. 1: off."""
    profile: ProfileCfg | None = None
    """`torch.profiler` over a few optimizer steps: a trace per process in `<run_dir>/profile/` (TensorBoard's
    profiler plugin or ui.perfetto.dev open it) and the operators' totals in `profile/summary.txt` (`null`: off)."""
    compile: bool = False
    """`torch.compile` the model (inductor) through Accelerate's dynamo plugin, block by block: Accelerate's regional
    compilation compiles each distinct repeated block once; a language model's loss is compiled beside them (it reads the
    logits without float32 copies). Checkpoints and exports keep plain parameter names."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """`torch.compile`'s mode, with `compile: true`."""
    activation_checkpointing: bool = False
    """Keep only each block's input in the forward pass and recompute the block in the backward pass (S4 and MoE
    blocks): activation memory of one block instead of all, for about one more forward pass of compute. The gradients
    are the same; needs a model with `activation_checkpointing_enable()` (every s4accel model)."""
    resume: Literal["auto"] | None = None
    """`auto`: continue from the newest complete checkpoint of the run directory when there is one, else start fresh
    (what `--resume` alone does), so that a job its launcher restarts (torchrun `--max-restarts`, SLURM `--requeue`)
    continues with the very same command. `null`: start fresh, and refuse a directory that holds a run. `--resume` on
    the command line wins over this key."""
    tf32: bool = False
    """On CUDA: float32 matmuls and convolutions in TF32 (`torch.set_float32_matmul_precision("high")`, Ampere or
    newer), faster at ~1e-3 relative precision: in a float32 run (no mixed precision) every Linear and the S4 layer's
    chunked convolution products, about twice as fast. Nothing changes on CPU, nor in the bf16/fp16 matmuls of a
    mixed-precision run."""
    peak_tflops: float | None = Field(None, gt=0)
    """Peak TFLOP/s of one device, what `train/mfu` divides by. `null`: the published dense peak of a known GPU for
    the run's precision (H100, H200, A100, L40S, L4, A10, RTX 4090, V100), or on a CPU a float32 matmul measured at
    the start of the run."""

    @model_validator(mode="before")
    @classmethod
    def _a_length(cls, data):
        """Without either length, the 1000 steps of old; resolved here (not a field default) so that a recipe
        giving only `max_epochs` has no step cap."""
        if isinstance(data, dict) and data.get("max_steps") is None and data.get("max_epochs") is None:
            data = {**data, "max_steps": 1000}
        return data

    @field_validator("max_time", mode="before")
    @classmethod
    def _a_duration(cls, value):
        """Checked here, kept as written (the recipe shows `1h30m`, not 5400.0)."""
        if value is not None:
            duration_seconds(value)
        return value

    @property
    def max_time_s(self) -> float | None:
        """`max_time` in seconds (None: no budget)."""
        return None if self.max_time is None else duration_seconds(self.max_time)

    @field_validator("eval_every", mode="before")
    @classmethod
    def _steps_or_epoch(cls, value):
        """One line for a wrong value (each branch of the union would give its own)."""
        if value == "epoch" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError(f"expected a number of steps (0: only at the end) or 'epoch', got {value!r}")

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
    """Whether a lower (`min`) or a higher (`max`) `best_metric` is better."""
    best_at_end: bool = False
    """At the end, `final/` (what `push`, `eval` and `from_pretrained` read) holds the best model kept by
    `keep_best` instead of the last weights: transformers.Trainer's `load_best_model_at_end`."""

    @model_validator(mode="after")
    def _best_needs_keeping(self):
        if self.best_at_end and not self.keep_best:
            raise ValueError("checkpoint.best_at_end: needs checkpoint.keep_best >= 1 (the best model is one of "
                             "those kept)")
        return self


class CallbackCfg(_Section):
    target: str
    """A `s4accel.Callback` as `package.module:Class` (importable where training runs) or `path/file.py:Class`
    (relative to the recipe's folder)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class."""

    @field_validator("target")
    @classmethod
    def _import_path(cls, target):
        if not re.fullmatch(IMPORT_TARGET, target):
            raise ValueError(f"expected 'package.module:Class' or 'path/file.py:Class', got {target!r}")
        return target


TRACKERS = ("tensorboard", "jsonl", "wandb", "mlflow", "aim", "comet_ml", "clearml", "dvclive", "swanlab", "trackio")


class LogCfg(_Section):
    log_with: list[str] = Field(default_factory=lambda: ["tensorboard", "jsonl"])
    """Trackers: `tensorboard` (event files under `<run_dir>/tensorboard`), `jsonl` (`<run_dir>/metrics.jsonl`), any
    of Accelerate's by name (`wandb`, `mlflow`, `aim`, `comet_ml`, `clearml`, `dvclive`, `swanlab`, `trackio`; their
    package installed), or your own `GeneralTracker` as `module:Class`. `metrics.jsonl` is written with any of them
    (the model card's curve and `s4accel push` read it); `[]`: no trackers at all. A tracker that fails never stops
    training."""
    project: str | None = None
    """The project (W&B, trackio, Comet, SwanLab, ClearML) or experiment (MLflow) that groups this run with others;
    each run keeps `run.name` as its own name there. `null`: the tracker's environment variable (`WANDB_PROJECT`,
    `MLFLOW_EXPERIMENT_NAME`, `COMET_PROJECT_NAME`, `CLEARML_PROJECT`) where it is set, else `run.name`."""
    tracker_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Extra constructor arguments per tracker name, e.g. `{wandb: {entity: me}}`."""
    tracker_retries: int = Field(3, ge=1)
    """Tries per tracker call before the tracker is disabled (with a warning)."""
    tracker_backoff_s: float = Field(0.5, ge=0)
    """Seconds before the second try; doubled for each further one."""
    tracker_timeout_s: float = Field(120.0, gt=0)
    """Seconds a tracker call may take; one that has not returned by then (a hung network call) disables that
    tracker, and training goes on."""

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
    """Create the repository private (an existing repository keeps its visibility)."""
    revision: str | None = None
    """Branch to push to (created if missing); None: main."""
    which: Literal["final", "best", "ema"] = "final"
    """Which model of the run: the final weights, the best one kept by `checkpoint.keep_best`, or the EMA weights."""

    @model_validator(mode="after")
    def _repo_when_pushing(self):
        if self.push_at_end and not self.repo_id:
            raise ValueError("hub.repo_id: needed when hub.push_at_end is true (owner/name)")
        return self


class SampleCfg(_Section):
    prompts: list[str] = Field(default_factory=list)
    """Prompts completed with `generate()` by the final model; written to `<run_dir>/samples.txt`."""
    max_new_tokens: int = Field(200, ge=1)
    """Tokens generated per prompt."""
    temperature: float = Field(0.8, ge=0)
    """0 means greedy decoding."""
    top_k: int | None = Field(None, ge=1)
    """Sample among the k most likely tokens only (`null`: all)."""
    seed: int = 0
    """Seed of the sampling, so the samples of a run can be compared with another's."""
