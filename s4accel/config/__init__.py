"""Recipes: YAML validated into typed config before anything heavy is imported or built (torch-free, so `--help` and
recipe errors answer at once)."""

from ..errors import RecipeError
from .load import load_recipe, validate_recipe
from .loop_sections import (CallbackCfg, CheckpointCfg, EarlyStoppingCfg, EMACfg, HubCfg, LogCfg, SampleCfg, StateCfg,
                            TrainCfg)
from .data_sections import DataCfg, SourceCfg
from .schema import ModelCfg, OptimCfg, Recipe, RunCfg, SchedulerCfg, TaskCfg, flatten
from .sizes import MODEL_SIZES

__all__ = ["RecipeError", "load_recipe", "validate_recipe", "Recipe", "RunCfg", "ModelCfg", "DataCfg", "OptimCfg",
           "SchedulerCfg", "SourceCfg", "TrainCfg", "EMACfg", "EarlyStoppingCfg", "StateCfg", "CheckpointCfg",
           "CallbackCfg", "LogCfg", "HubCfg", "TaskCfg", "SampleCfg", "flatten", "MODEL_SIZES"]
