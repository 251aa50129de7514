"""s4accel: train S4 and mixture-of-experts sequence models with HuggingFace Accelerate.

Public API (each name imports its heavy dependencies only when first used):

    >>> import s4accel
    >>> recipe = s4accel.load_recipe("recipes/quickstart.yaml", ["train.max_steps=10"])
    >>> result = s4accel.train(recipe)

`import s4accel` also registers the models with transformers' Auto classes (the call below `_LAZY`), so
`AutoModelForCausalLM.from_pretrained(run_dir / "final")` works.
"""

import importlib

from ._autoregister import register_when_transformers_loads

__version__ = "0.1.0"

_LAZY = {
    "load_recipe": "s4accel.config",
    "Recipe": "s4accel.config",
    "RecipeError": "s4accel.errors",
    "train": "s4accel.tools.run",
    "TrainResult": "s4accel.training",
    "Task": "s4accel.training.task",
    "TaskData": "s4accel.training.task",
    "TaskContext": "s4accel.training.task",
    "TrainOptimizer": "s4accel.training.task",
    "Callback": "s4accel.training.callbacks",
    "MODEL_SIZES": "s4accel.config.sizes",
    "S4Config": "s4accel.models",
    "S4PreTrainedModel": "s4accel.models",
    "S4Model": "s4accel.models",
    "S4ForCausalLM": "s4accel.models",
    "S4ForSequenceClassification": "s4accel.models",
    "S4Cache": "s4accel.models",
    "MoEConfig": "s4accel.models",
    "MoEModel": "s4accel.models",
    "MoEForCausalLM": "s4accel.models",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 's4accel' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


# The models join transformers' Auto classes (AutoConfig, AutoModel, AutoModelForCausalLM,
# AutoModelForSequenceClassification) here: at once if transformers is imported already, else the moment it finishes
# importing. Not by importing it now: its model classes take ~3.5 s, which `s4accel --help` and a recipe error must
# not pay.
register_when_transformers_loads()

__all__ = ["__version__", *_LAZY]
