"""Model families of s4accel: one `configuration_X.py` + `modeling_X.py` pair per family (transformers layout).

The pairs stand alone (torch + transformers imports only): they are copied into Hub repositories for
`trust_remote_code` loading. Named sizes live in `s4accel/sizes.py`.
"""

import importlib

# transformers first, before our model files: importing it runs s4accel's Auto-class registration (see
# s4accel/_autoregister.py), which needs our model files to load whole, not half-way through their own imports.
import transformers  # noqa: F401

from ..sizes import FAMILIES
from .configuration_moe import MoEConfig
from .configuration_s4 import S4Config
from .modeling_moe import MoEForCausalLM, MoEModel, MoEPreTrainedModel
from .modeling_s4 import S4Cache, S4ForCausalLM, S4ForSequenceClassification, S4Model, S4PreTrainedModel


def family_classes(family: str):
    """(config class, causal LM class) of a family, e.g. `family_classes("s4")`."""
    refs = [ref.split(":") for ref in FAMILIES[family]]
    return tuple(getattr(importlib.import_module(f".{module}", __name__), cls) for module, cls in refs)


__all__ = ["MoEConfig", "MoEPreTrainedModel", "MoEModel", "MoEForCausalLM", "S4Config", "S4PreTrainedModel", "S4Model", "S4ForCausalLM", "S4ForSequenceClassification", "S4Cache",
           "family_classes"]
