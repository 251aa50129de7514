"""The recipe schema: one pydantic section per concern (run, task, model, data, optim, scheduler, train, checkpoint,
log, sample, hub, callbacks), a docstring on every field, cross-field checks. The loop's sections are in
`loop_sections.py`, the data's in `data_sections.py`, the optimizer's and schedule's in `optim_sections.py`, their
base in `base.py`; reading YAML and the error text live in `load.py`, the named model sizes
in `sizes.py`.

Model hyperparameters are not duplicated here: `model.overrides` names fields of the model family's own
`PreTrainedConfig` (checked by name here, by value when the config is built).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from ..errors import did_you_mean as _did_you_mean
from .base import IMPORT_TARGET
from .base import Section as _Section
from .data_sections import DataCfg
from .loop_sections import CallbackCfg, CheckpointCfg, HubCfg, LogCfg, SampleCfg, TrainCfg
from .optim_sections import OptimCfg, SchedulerCfg
from .sizes import MODEL_SIZES, config_fields
from .sweep_sections import SweepCfg

TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "eos_token_id", "d_input", "input_mean", "input_scale")


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
    version: Literal["none", "number", "time"] = "none"
    """Without out_dir: each new run a folder (`number`: name, name-1, ...; `time`: name-YYYYmmdd-HHMMSS), or none."""

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


class LoraCfg(_Section):
    """LoRA adapters through PEFT (`pip install s4accel[lora]`): the base model stays fixed, low-rank updates of the
    named modules and parameters train. Names match as PEFT matches a list: a module or parameter whose dotted name
    is the pattern or ends with `.pattern` (`output_linear`, `attn.qkv_proj`, `layers.0.layer.output_linear`)."""

    r: int = Field(8, ge=1)
    """Rank of each update (PEFT's `r`)."""
    alpha: float = Field(16, gt=0)
    """Scale of the update: it is multiplied by `alpha / r` (PEFT's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on an adapted module's input, on the low-rank path only (PEFT's `lora_dropout`). PEFT has none for
    `target_parameters`: 0 there."""
    target_modules: list[str] = Field(default_factory=list)
    """Layers to adapt: S4's `output_linear`; the MoE models' `qkv_proj`, `o_proj`, `router`, the dense blocks' and
    shared experts' `gate_up_proj`/`down_proj` (nn.Linear, nn.Embedding, convolutions)."""
    target_parameters: list[str] = Field(default_factory=list)
    """Weights that are parameters of a module rather than layers of their own, adapted where they are used (PEFT's
    `target_parameters`): the experts' 3-D `experts.gate_up_proj` (E, 2F, D) and `experts.down_proj` (E, D, F), a
    rank-`r` update per expert; 2-D and 3-D parameters only."""

    @field_validator("target_modules", "target_parameters")
    @classmethod
    def _plain_names(cls, names):
        bad = next((n for n in names if not n or n != n.strip() or n.startswith(".") or n.endswith(".")), None)
        if bad is not None:
            raise ValueError(f"{bad!r} is not a module or parameter name (e.g. output_linear, attn.qkv_proj)")
        if len(set(names)) != len(names):
            raise ValueError(f"{names}: a name is listed twice")
        return names

    @model_validator(mode="after")
    def _something_to_adapt(self):
        if not self.target_modules and not self.target_parameters:
            raise ValueError("model.lora: name what to adapt in target_modules (e.g. [output_linear]) or "
                             "target_parameters (e.g. [experts.gate_up_proj])")
        if self.target_parameters and self.dropout:
            raise ValueError(f"model.lora.dropout: PEFT applies no dropout to LoRA on parameters (target_parameters "
                             f"{self.target_parameters}): the input of W + BA cannot be dropped on the BA path alone; "
                             f"set dropout: 0")
        return self


class ModelCfg(_Section):
    name: str | None = "s4-small"
    """A named size from `s4accel.config.sizes.MODEL_SIZES` (see `s4accel models`); none with `pretrained`."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the family's config class that replace the named size's values, e.g. `{dropout: 0.1}`. With
    `pretrained`: only fields that leave the weights valid (dropout, pooling, the router's coefficients, ...)."""
    pretrained: str | None = None
    """Start from trained weights: a model directory, a run directory (its `final/`, or `which`), or a Hub repo id,
    read through the safe loader (safetensors only, no remote code). The architecture comes from its config; training
    starts at step 0 with a fresh optimizer. A language model's weights can start a classifier (a new head)."""
    revision: str | None = None
    """With `pretrained` from the Hub: a branch, tag or commit."""
    which: Literal["final", "best", "ema"] = "final"
    """With `pretrained` a run directory: its final weights, the best kept by `checkpoint.keep_best`, or the EMA."""
    new_weights: list[str] | None = None
    """Parameter-name patterns (`fnmatch`, e.g. `score.*`) that may start untrained: not in the pretrained weights, or
    of another shape. `null`: the task's head (a classifier's `score.*`). Anything else left untrained is an error."""
    state_hook: str | None = None
    """`module:function` or `path/file.py:function` receiving the loaded state dict and the new model and returning
    the state dict to load (renamed, reshaped or dropped keys), as the state-spaces/s4 trainer's
    `pretrained_model_state_hook` does."""
    freeze: list[str] = Field(default_factory=list)
    """Parameter-name patterns (`fnmatch`, e.g. `backbone.*`) kept fixed: not trained, not in the optimizer."""
    lora: LoraCfg | None = None
    """Train LoRA adapters (PEFT) instead of the model's weights: `{r, alpha, dropout, target_modules,
    target_parameters}`. The base is `pretrained` or, without it, the freshly initialised model; `final/` holds the
    adapter (and, for a fresh base, the base in `final/base/`); `s4accel export RUN --merge OUT` writes a plain
    model."""

    @field_validator("name")
    @classmethod
    def _known_size(cls, name):
        if name is not None and name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r}{_did_you_mean(name, MODEL_SIZES)}; "
                             f"allowed: {', '.join(MODEL_SIZES)}")
        return name

    @model_validator(mode="after")
    def _size_or_pretrained(self):
        if self.pretrained is not None:
            # The architecture comes from the pretrained model's config, so a recipe's size gives way to it: adding
            # `--set model.pretrained=...` to a recipe that names a size needs nothing else. An override that would
            # change what the weights mean is refused when the pretrained config is read.
            object.__setattr__(self, "name", None)  # written back as `name: null`, so the recipe reloads
        elif self.name is None:
            raise ValueError("model.name: give a model size (see `s4accel models`) or model.pretrained")
        if self.lora is not None and self.freeze:
            raise ValueError("model.freeze: with model.lora only the adapters train (and a classifier's head); the "
                             "base is fixed already, so remove model.freeze")
        if self.pretrained is None and (self.state_hook or self.new_weights is not None or self.revision):
            raise ValueError("model.state_hook, model.new_weights and model.revision go with model.pretrained")
        if self.pretrained is None:  # with `pretrained`, its family's fields are checked when it is read
            allowed = [f for f in config_fields(MODEL_SIZES[self.name]["family"]) if f not in TOKENIZER_FIELDS]
            for key in self.overrides:
                if key not in allowed:
                    hint = (" (set from the tokenizer or the data)" if key in TOKENIZER_FIELDS
                            else _did_you_mean(key, allowed))
                    raise ValueError(f"model.overrides: unknown key {key!r}{hint}; allowed: {', '.join(allowed)}")
        return self


BUILTIN_TASK_NAMES = ("causal_lm", "classification")


class TaskCfg(_Section):
    target: str | None = None
    """What the run trains (s4accel/training/task.py): `causal_lm` or `classification` (the built-ins), or your own
    `s4accel.Task` subclass as `package.module:Class` or `path/to/file.py:Class`. `null`: `causal_lm` for text
    data, `classification` for array data."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the task's constructor."""
    metrics: list[str] = Field(default_factory=list)
    """Metrics of your own, each a function `(predictions, labels) -> number | {name: number}` as
    `package.module:function` or `path/to/file.py:function`, given every evaluated sample's predicted and true class
    (value, for regression) as 1-D tensors gathered from all processes (s4accel/training/observe/recipe_metrics.py); logged
    beside the task's metrics, a number under the function's name. The classification task hands them over; a task of
    your own does when its `gathered` lists `prediction` and `label`."""

    @field_validator("metrics")
    @classmethod
    def _function_paths(cls, targets):
        for target in targets:
            if not re.fullmatch(IMPORT_TARGET, target):
                raise ValueError(f"expected 'package.module:function' or 'path/file.py:function', got {target!r}")
        return targets

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


class Recipe(_Section):
    run: RunCfg = Field(default_factory=RunCfg)
    """Name, directory, seed, overwrite."""
    model: ModelCfg = Field(default_factory=ModelCfg)
    """A named size and the config fields that change it."""
    data: DataCfg = Field(default_factory=DataCfg)
    """Where the data comes from, how it is tokenised and batched."""
    optim: OptimCfg = Field(default_factory=OptimCfg)
    """The optimizer (AdamW by default) and its parameter groups."""
    scheduler: SchedulerCfg = Field(default_factory=SchedulerCfg)
    """The learning-rate schedule and its warmup."""
    train: TrainCfg = Field(default_factory=TrainCfg)
    """The loop: steps, accumulation, precision, clipping, evaluation, bad numbers, EMA, early stopping, switches."""
    checkpoint: CheckpointCfg = Field(default_factory=CheckpointCfg)
    """Full training states and the best models."""
    log: LogCfg = Field(default_factory=LogCfg)
    """Trackers, intervals, the progress bar."""
    sample: SampleCfg = Field(default_factory=SampleCfg)
    """Prompts the final language model completes."""
    hub: HubCfg = Field(default_factory=HubCfg)
    """Pushing the model to the Hub when training ends."""
    task: TaskCfg = Field(default_factory=TaskCfg)
    """What the run trains: a built-in task or your own."""
    callbacks: list[CallbackCfg] = Field(default_factory=list)
    """Your own callbacks, called after the built-ins in this order."""
    sweep: SweepCfg | None = None
    """What `s4accel sweep` searches: recipe keys, their values, the metric (`s4accel train` ignores it)."""

    @model_validator(mode="after")
    def _state_needs_text(self):
        if self.train.state.mode != "none" and not self.data.is_lm:
            raise ValueError(f"train.state.mode: {self.train.state.mode!r} carries state along text streams; this "
                             f"data has independent labelled sequences (use mode none)")
        if self.train.state.mode != "none" and self.data.max_train_examples is not None:
            raise ValueError(f"data.max_train_examples draws examples at random; train.state.mode "
                             f"{self.train.state.mode!r} reads the text in order (use mode none, or less text)")
        if self.train.state.mode != "none" and self.data.streaming:
            raise ValueError(f"train.state.mode: {self.train.state.mode!r} lays the training text out in fixed "
                             f"rows; with data.streaming the text is read once, in order (use mode none)")
        return self

    @model_validator(mode="after")
    def _context_parallel_fits(self):
        """What a sequence split across processes cannot do, refused before any compute."""
        P = self.train.context_parallel
        if P == 1:
            return self
        key = f"train.context_parallel: {P}"
        family = MODEL_SIZES.get(self.model.name or "", {}).get("family") if self.model.pretrained is None else None
        if family == "moe":
            raise ValueError(f"{key} splits S4 models along the sequence; the MoE transformer's attention is not "
                             f"split here (for attention, Accelerate's context parallelism, ParallelismConfig(cp_size"
                             f"=...) with FSDP2, runs ring attention through SDPA on GPUs)")
        if self.train.state.mode != "none":
            raise ValueError(f"{key}: stateful training (train.state.mode: {self.train.state.mode}) carries a state "
                             f"from batch to batch; a split sequence is read whole in each step (use one of them)")
        if self.data.streaming:
            raise ValueError(f"{key}: a streamed source gives each process its own blocks; the processes of a context "
                             f"group must read the same ones (use a map-style source)")
        if self.train.compile:
            raise ValueError(f"{key} is not compiled: the state exchange is a collective inside every layer (set "
                             f"train.compile: false)")
        if self.task.target not in (None, "causal_lm", "classification"):
            raise ValueError(f"{key} splits the batches of the built-in tasks (causal_lm, classification); "
                             f"{self.task.target} would see chunks of sequences")
        overrides = self.model.overrides
        if overrides.get("capacity_factor") is not None or overrides.get("router_jitter"):
            raise ValueError(f"{key}: capacity_factor and router_jitter depend on the whole batch's token order; "
                             f"unset them in model.overrides")
        if self.data.is_lm and self.data.seq_len % P:
            raise ValueError(f"{key} must divide data.seq_len={self.data.seq_len} into equal chunks")
        return self

    @model_validator(mode="after")
    def _smoothing_needs_classes(self):
        if self.train.label_smoothing and self.data.source == "arrays" and self.data.task == "regression":
            raise ValueError("train.label_smoothing smooths class targets; data.task regression predicts numbers "
                             "(remove it)")
        return self

    @model_validator(mode="after")
    def _prompts_need_text(self):
        if self.sample.prompts and not self.data.is_lm:
            raise ValueError("sample.prompts: this data trains a sequence classifier, which does not generate text; "
                             "remove the prompts")
        return self

    @model_validator(mode="after")
    def _builtin_task_fits_data(self):
        kind = "text" if self.data.is_lm else "labelled text" if self.data.is_text else "array"
        wanted = {"causal_lm": ("text",), "classification": ("labelled text", "array")}.get(self.task.target)
        if wanted is not None and kind not in wanted:
            what = "documents with data.label_field" if kind == "text" else f"data.source {self.data.source!r}"
            raise ValueError(f"task.target: {self.task.target!r} trains on {' or '.join(wanted)} data, but "
                             f"{what} is {kind} data")
        return self

    @model_validator(mode="after")
    def _epochs_need_an_end(self):
        if self.train.max_epochs is not None and self.data.streaming:
            raise ValueError("train.max_epochs: a streamed source is read without knowing its length, so it has no "
                             "epochs; set train.max_steps instead")
        if self.train.eval_every == "epoch" and self.data.streaming:
            raise ValueError("train.eval_every: a streamed source is read without knowing its length, so it has no "
                             "epochs to evaluate after; evaluate every N steps instead (train.eval_every: N)")
        return self

    def total_steps_for(self, batches_per_epoch: int | None) -> int:
        """Optimizer steps the run trains for: `train.max_steps`, or what `train.max_epochs` comes to with
        `batches_per_epoch` training batches per process and pass (the smaller when both are set)."""
        cfg = self.train
        if cfg.max_epochs is None:
            return cfg.max_steps
        if batches_per_epoch is None:
            raise ValueError("train.max_epochs: the number of steps is known once the data is built")
        by_epochs = max(1, math.ceil(cfg.max_epochs * batches_per_epoch / cfg.grad_accum))
        return by_epochs if cfg.max_steps is None else min(by_epochs, cfg.max_steps)

    def warmup_steps_for(self, total_steps: int) -> int:
        """The warmup of a run of `total_steps` steps: `scheduler.warmup_steps`, or `warmup_ratio` of the run; a
        warmup longer than the run is cut to the run (`warmup_note` says so), so that `--set train.max_steps=1`
        runs a recipe as it is."""
        if self.scheduler.warmup_steps or not self.scheduler.warmup_ratio:
            return min(self.scheduler.warmup_steps, total_steps)
        return math.ceil(self.scheduler.warmup_ratio * total_steps)  # < total_steps: the ratio is below 1

    def warmup_note(self, total_steps: int) -> str | None:
        """The line a run prints when `warmup_steps_for` cut the warmup to the run; None when it did not."""
        asked = self.scheduler.warmup_steps
        if asked <= total_steps:
            return None
        length = (f"train.max_steps={total_steps}" if self.train.max_epochs is None or total_steps ==
                  self.train.max_steps else f"the {total_steps} steps of train.max_epochs={self.train.max_epochs}")
        return (f"scheduler.warmup_steps={asked} is longer than the run ({length}): warming up over all {total_steps} "
                f"step(s) instead (scheduler.warmup_ratio scales the warmup with the run)")

    @property
    def total_steps(self) -> int:
        """`train.max_steps`; with `train.max_epochs` the run's length depends on its data: ask its plan
        (`training/plan.py`) instead."""
        return self.total_steps_for(None)

    @property
    def warmup_steps(self) -> int:
        return self.warmup_steps_for(self.total_steps)

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


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
