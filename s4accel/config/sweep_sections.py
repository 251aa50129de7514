"""The recipe's `sweep` section: what `s4accel sweep RECIPE` searches (transformers.Trainer's `hyperparameter_search`
through Optuna). `s4accel train` ignores it. Whether each value it names is one the recipe takes is checked by the
sweep before its first trial (tools/sweep.py), by validating the recipe with it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from .base import Section as _Section


class SweepRange(_Section):
    """Numbers from `low` to `high` (both included): integers when both are integers, else floats."""

    low: float | int
    """The smallest value tried."""
    high: float | int
    """The largest value tried."""
    log: bool = False
    """Sampled uniformly in log space (a learning rate: 1e-4 .. 1e-2); `low` above 0."""
    step: float | int | None = Field(None, gt=0)
    """Only `low`, `low + step`, ... (not with `log`)."""

    @model_validator(mode="after")
    def _a_range(self):
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log needs low above 0, got {self.low}")
        if self.log and self.step is not None:
            raise ValueError("step and log: one or the other")
        return self

    @property
    def integer(self) -> bool:
        return all(isinstance(v, int) for v in (self.low, self.high, self.step if self.step is not None else 1))

    def corners(self) -> list:
        """The values at its ends, which every sampled value lies between."""
        return [self.low, self.high]


class SweepPruning(_Section):
    """Optuna's median rule: a trial whose evaluation is worse than the median of the earlier trials' evaluations at
    the same step stops there (its model and metrics are kept; it is counted as pruned)."""

    after_trials: int = Field(5, ge=0)
    """Trials that run to their end before any is pruned (the median needs some)."""
    after_steps: int = Field(0, ge=0)
    """Optimizer steps of a trial before it may be pruned."""


class SweepCfg(_Section):
    trials: int = Field(20, ge=1)
    """Trials in all. The study is kept in `<run dir>-sweep/study.db`: the same command again continues it (a trial
    stopped by Ctrl-C or lost with its machine first resumes from its checkpoint), and several commands at once (one
    per GPU) share its trials."""
    params: dict[str, list[Any] | SweepRange] = Field(default_factory=dict)
    """Recipe keys (`optim.lr`, `data.batch_size`, `model.overrides.d_model`) and their values to try: a list, or a
    range `{low, high}` (with `log: true` or a `step`)."""
    metric: str = "loss"
    """The evaluation metric the sweep optimises: each trial's last evaluation (a trial evaluates at its end)."""
    mode: Literal["min", "max"] = "min"
    """Whether a lower (`min`, a loss) or a higher (`max`, an accuracy) value is better."""
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    """`tpe`: Optuna's Tree-structured Parzen Estimator, which tries values near the best so far; `random`; `grid`:
    every combination of the lists, in the order written (`trials` at most), lists only."""
    seed: int | None = None
    """The sampler's seed (`null`: `run.seed`)."""
    prune: SweepPruning | None = Field(default_factory=SweepPruning)
    """Stop unpromising trials at an evaluation (`null`: every trial runs to its end)."""

    @field_validator("params", mode="before")
    @classmethod
    def _lists_or_ranges(cls, params):
        """One line for a wrong value (each branch of the union would give its own)."""
        if not isinstance(params, dict):
            return params
        out = {}
        for key, space in params.items():
            if isinstance(space, dict):
                try:
                    space = SweepRange.model_validate(space)
                except ValidationError as e:
                    err = e.errors()[0]
                    where = ".".join(str(p) for p in err["loc"])
                    raise ValueError(f"{key}{'.' + where if where else ''}: {err['msg'].removeprefix('Value error, ')}"
                                     ) from None
            elif not isinstance(space, list | SweepRange):
                raise ValueError(f"{key}: expected a list of values or a range {{low, high}}, got {space!r}")
            out[key] = space
        return out

    @model_validator(mode="after")
    def _searchable(self):
        if not self.params:
            raise ValueError("params: name at least one recipe key and the values to try, e.g. "
                             "{optim.lr: {low: 1.0e-4, high: 1.0e-2, log: true}}")
        for key, space in self.params.items():
            if isinstance(space, list) and not space:
                raise ValueError(f"params.{key}: an empty list of values")
            if "." not in key:
                raise ValueError(f"params.{key}: expected a recipe key with its section, e.g. optim.lr")
        if self.sampler == "grid":
            ranges = [k for k, v in self.params.items() if isinstance(v, SweepRange)]
            if ranges:
                raise ValueError(f"sampler grid tries lists of values; {', '.join(ranges)} is a range")
        return self

    def grid(self) -> list[dict]:
        """Every combination of the lists, the first key's values changing slowest."""
        combos = [{}]
        for key, values in self.params.items():
            combos = [{**c, key: v} for c in combos for v in values]
        return combos
