"""The recipe sections of the optimizer and its learning-rate schedule: optim (which optimizer, its arguments, the
parameter groups' rates) and scheduler. A docstring on every field; torch-free, like every section (the optimizer's
arguments are checked against its class by training/optim.py, before any data is read)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from ..errors import did_you_mean as _did_you_mean
from .base import IMPORT_TARGET
from .base import Section as _Section

TORCH_OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "rmsprop", "nadam", "radam", "adamax", "adagrad",
                    "adadelta", "asgd", "rprop", "muon")
"""The optimizers of `torch.optim` a recipe names (the class name in lower case); `NOT_RECIPE_OPTIMIZERS` says why
not the others."""

NOT_RECIPE_OPTIMIZERS = {
    "lbfgs": "its step re-evaluates the loss in a closure, which a training step does not give",
    "sparseadam": "it takes sparse gradients only",
}


class OptimCfg(_Section):
    name: str = "adamw"
    """The optimizer, given every trained parameter in the groups below: `adamw`, or another of `torch.optim`'s by
    its class name in lower case (`adam`, `sgd`, `adafactor`, `rmsprop`, `nadam`, `radam`, `adamax`, `adagrad`,
    `adadelta`, `asgd`, `rprop`), or a class of another package or your own as `package.module:Class` or
    `path/to/file.py:Class`, taking torch's `(params, lr=..., weight_decay=...)` and `param_groups`. `betas` and
    `eps` go to one that takes them; its other arguments are `kwargs`. `muon`: torch's Muon for the 2-D matrices of
    the model's blocks (its updates scaled to AdamW's size, so `lr` serves both; `kwargs` are Muon's), AdamW for
    every other parameter (embeddings, heads, vectors, SSM parameters, 3-D expert weights); one process or DDP."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The optimizer's other constructor arguments, e.g. `{momentum: 0.9, nesterov: true}` for `sgd`, checked
    against its signature before anything is built (`lr`, `weight_decay`, `betas`, `eps` and `fused` are the keys
    above)."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate (after warmup) of all parameters but the SSM ones."""
    weight_decay: float = Field(0.01, ge=0)
    """Weight decay, only on matrices (ndim >= 2), never on biases, norms or SSM parameters: the optimizer's own kind
    (AdamW's decoupled, Adam's and SGD's added to the gradient). 0 for one without weight decay (`rprop`)."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.98)
    """(beta1, beta2) of the Adam family (`adamw`, `adam`, `nadam`, `radam`, `adamax`; any optimizer taking
    `betas`), each in [0, 1); another optimizer's moment decay is in `kwargs` (`rmsprop`'s `alpha`)."""
    eps: float = Field(1e-8, gt=0)
    """Epsilon added to the denominator for numerical stability, for an optimizer taking one number `eps` (`adafactor`
    takes a pair: `kwargs: {eps: [null, 0.001]}`)."""
    ssm_lr: float = Field(1e-3, gt=0)
    """Learning rate of the SSM parameters named in `ssm_params` (the reference uses min(1e-3, lr))."""
    ssm_params: list[str] = Field(default_factory=lambda: ["log_dt", "log_A_real", "A_imag", "P", "B"])
    """Parameter names (last dotted component) that form the SSM group: own lr, no weight decay."""
    fused: bool | None = None
    """The optimizer's fused kernel (one kernel for all parameters): `null` uses it for `adamw`, `adam` and `sgd`
    where the device has one (CUDA, CPU), else the multi-tensor (`foreach`) implementation; `true` asks any
    optimizer that has one (`adagrad` too); `false` forces `foreach`."""

    @model_validator(mode="before")
    @classmethod
    def _a_section(cls, value):
        if isinstance(value, str):  # transformers.Trainer's `optim="sgd"`
            raise ValueError(f"a section, not a name: the optimizer is optim.name (optim: {{name: {value}}})")
        return value

    @field_validator("name")
    @classmethod
    def _optimizer_name(cls, name):
        if name in TORCH_OPTIMIZERS:
            return name
        if name.lower() in NOT_RECIPE_OPTIMIZERS:
            raise ValueError(f"{name}: not a recipe's optimizer: {NOT_RECIPE_OPTIMIZERS[name.lower()]}")
        if name.lower() in TORCH_OPTIMIZERS:
            raise ValueError(f"torch.optim's names are in lower case here: {name.lower()!r}")
        if not re.fullmatch(IMPORT_TARGET, name):
            raise ValueError(f"expected one of {', '.join(TORCH_OPTIMIZERS)}, or 'package.module:Class' or "
                             f"'path/file.py:Class', got {name!r}{_did_you_mean(name, TORCH_OPTIMIZERS)}")
        return name

    @field_validator("kwargs")
    @classmethod
    def _own_keys(cls, kwargs):
        for key in ("params", "lr", "weight_decay", "betas", "fused", "foreach"):
            if key in kwargs:
                where = ("optim.fused" if key == "foreach" else
                         "the parameter groups s4accel builds" if key == "params" else f"optim.{key}")
                raise ValueError(f"{key} is set by {where}, not in kwargs")
        return kwargs


SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr", "inverse_sqrt",
              "polynomial", "warmup_stable_decay", "step", "exponential", "cosine_annealing", "lambda")

TORCH_SCHEDULES = {
    "step": {"step_size": None, "gamma": 0.1},  # torch's StepLR
    "exponential": {"gamma": None},  # ExponentialLR
    "cosine_annealing": {"T_max": "the steps after warmup", "eta_min": 0.0},  # CosineAnnealingLR
    "lambda": {"target": None},  # LambdaLR: `module:function` or `file.py:function`, step -> multiplier
}
"""The schedules of `torch.optim.lr_scheduler` a recipe names, with their `scheduler.kwargs` and defaults (None:
required)."""


class SchedulerCfg(_Section):
    name: Literal[SCHEDULERS] = "cosine"  # type: ignore[valid-type]
    """A `transformers.get_scheduler` schedule, or one of torch's: `step` (StepLR: `kwargs: {step_size, gamma}`),
    `exponential` (ExponentialLR: `{gamma}`), `cosine_annealing` (CosineAnnealingLR: `{T_max, eta_min}`, T_max the
    steps after warmup by default), `lambda` (`{target: module:function}`, the learning-rate multiplier as a
    function of the step). Torch's count their steps from the end of the warmup. Stepped once per optimizer step."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup length in optimizer steps; one longer than the run is cut to the run, with a line saying so."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Warmup as a fraction of the run's optimizer steps (`train.max_steps`, or what `train.max_epochs` comes to),
    rounded up; exclusive with `warmup_steps`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Schedule-specific arguments, e.g. `{min_lr_rate: 0.1}` for `cosine_with_min_lr`."""

    @model_validator(mode="after")
    def _one_warmup(self):
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        spec = TORCH_SCHEDULES.get(self.name)
        if spec is not None:
            unknown = sorted(set(self.kwargs) - set(spec))
            missing = [k for k, v in spec.items() if v is None and k not in self.kwargs]
            if unknown or missing:
                what = f"unknown {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}"
                raise ValueError(f"kwargs: {what} for {self.name} (takes {', '.join(spec)})")
            numbers = {k: v for k, v in self.kwargs.items() if k != "target"}
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in numbers.values()):
                raise ValueError(f"kwargs: {self.name} takes non-negative numbers, got {numbers}")
            if self.kwargs.get("step_size", 1) < 1 or self.kwargs.get("T_max", 1) < 1:
                raise ValueError("kwargs: step_size and T_max must be at least 1")
        return self
