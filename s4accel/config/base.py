"""The base of every recipe section: unknown keys refused, finite numbers only, no `true` for a number."""

from __future__ import annotations

import types
import typing
from typing import Annotated

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

IMPORT_TARGET = r"([A-Za-z_][\w.]*|[^:\s]+\.py):[A-Za-z_][\w.]*"
"""What a recipe names to import (training/imports.py): `package.module:attr` or `path/to/file.py:attr`."""


class Section(BaseModel):
    # allow_inf_nan=False: `.inf` and `.nan` are valid YAML floats, and an infinite lr or weight decay only shows up
    # later as NaN weights.
    # frozen: a recipe is read once and never changes (what the data decides lives in the run's plan), so every part
    # of a run reads the same recipe it was validated as.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value, info: ValidationInfo):
        """pydantic's lax mode reads `true` as 1 for an int or float field (`max_steps: true` would train one step);
        a boolean is accepted only where the field's type admits one."""
        if isinstance(value, bool):
            kinds = _leaf_types(cls.model_fields[info.field_name].annotation)
            if bool not in kinds and kinds & {int, float}:
                kind = "integer" if int in kinds else "number"
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
