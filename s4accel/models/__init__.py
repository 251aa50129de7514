"""Model families of s4accel: one `configuration_X.py` + `modeling_X.py` pair per family (transformers layout).

The pairs stand alone (torch + transformers imports only): they are copied into Hub repositories for
`trust_remote_code` loading; nothing here imports the rest of s4accel. Named sizes live in `s4accel/config/sizes.py`.
"""

# transformers first, before our model files: importing it runs s4accel's Auto-class registration (see
# s4accel/_autoregister.py), which needs our model files to load whole, not half-way through their own imports.
import transformers  # noqa: F401

from .configuration_moe import MoEConfig
from .configuration_s4 import S4Config
from .modeling_moe import MoEForCausalLM, MoEModel, MoEPreTrainedModel
from .modeling_s4 import S4Cache, S4ForCausalLM, S4ForSequenceClassification, S4Model, S4PreTrainedModel


__all__ = ["MoEConfig", "MoEPreTrainedModel", "MoEModel", "MoEForCausalLM", "S4Config", "S4PreTrainedModel", "S4Model",
           "S4ForCausalLM", "S4ForSequenceClassification", "S4Cache"]
