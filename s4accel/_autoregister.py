"""Register s4accel's models with transformers' Auto classes without importing transformers at `import s4accel`.

Importing transformers' model classes costs ~4 s (it imports torch), which the CLI's `--help` and recipe errors must
not pay. So `import s4accel` registers at once only if transformers is already imported; otherwise a one-shot import
hook registers right after transformers itself finishes importing. Either way, after `import s4accel`,
`AutoModelForCausalLM.from_pretrained(run_dir)` finds our classes.
"""

import importlib.abc
import importlib.util
import sys
import warnings


def register_auto_classes() -> None:
    """Make `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and `AutoModelForSequenceClassification` know every
    family. Idempotent."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    from .models.configuration_moe import MoEConfig
    from .models.configuration_s4 import S4Config
    from .models.modeling_moe import MoEForCausalLM, MoEModel
    from .models.modeling_s4 import S4ForCausalLM, S4ForSequenceClassification, S4Model

    AutoConfig.register(S4Config.model_type, S4Config, exist_ok=True)
    AutoModel.register(S4Config, S4Model, exist_ok=True)
    AutoModelForCausalLM.register(S4Config, S4ForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(S4Config, S4ForSequenceClassification, exist_ok=True)
    AutoConfig.register(MoEConfig.model_type, MoEConfig, exist_ok=True)
    AutoModel.register(MoEConfig, MoEModel, exist_ok=True)
    AutoModelForCausalLM.register(MoEConfig, MoEForCausalLM, exist_ok=True)


def _register() -> None:
    try:
        register_auto_classes()
    except ImportError as e:  # e.g. torch missing: transformers stays usable for tokenizers, we just do not register
        warnings.warn(f"s4accel could not register its models with transformers: {e}", stacklevel=2)


class _RegisterAfterTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; also lets the lookup below use the normal finders
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_transformers_loads() -> None:
    """Register now if transformers is imported, else right after its import finishes (a one-shot import hook)."""
    if "transformers" in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterTransformers())
