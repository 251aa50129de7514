"""Named model sizes: a recipe says `model: {name: s4-small, overrides: {...}}`.

Plain data and the standard library only (no torch, no transformers), so a recipe is checked in milliseconds. Each
size names its family and the config fields it sets; everything else keeps the config class's defaults.
"""

import ast
import functools
from pathlib import Path

MODEL_SIZES: dict[str, dict] = {
    # 38k parameters (byte vocabulary): unit tests and CPU smoke runs.
    "s4-tiny": {"family": "s4", "d_model": 64, "n_layer": 2, "d_state": 16},
    # 0.73M parameters: the quick-start, a few minutes on 2 CPU cores.
    "s4-small": {"family": "s4", "d_model": 256, "n_layer": 4, "d_state": 64},
    # 4.9M parameters: a single-GPU run.
    "s4-base": {"family": "s4", "d_model": 512, "n_layer": 8, "d_state": 64},
    # 36M parameters.
    "s4-large": {"family": "s4", "d_model": 1024, "n_layer": 16, "d_state": 64},
    # Mixture-of-experts transformers (8 experts, top-2); `overrides: {use_moe: false}` gives the dense baseline of
    # the same shape (one expert's width).
    # 0.25M parameters (0.15M active per token): tests and smoke runs.
    "moe-tiny": {"family": "moe", "d_model": 64, "n_layer": 2, "n_head": 4, "d_ffn": 128, "num_experts": 4},
    # 3.4M parameters, 1.1M active per token (the dense baseline: 0.69M): CPU comparisons on Shakespeare.
    "moe-small": {"family": "moe", "d_model": 128, "n_layer": 4, "n_head": 4, "d_ffn": 256, "num_experts": 8},
    # 109M parameters, 34M active: a single-GPU run.
    "moe-base": {"family": "moe", "d_model": 512, "n_layer": 8, "n_head": 8, "d_ffn": 1024, "num_experts": 8},
}

# family -> its config class's file in s4accel/models and name: named, not imported, because recipes are checked
# without importing torch or transformers (`config_fields` reads the file). The classes themselves: CONFIG_CLASSES in
# training/tasks_builtin.py.
FAMILIES: dict[str, tuple[str, str]] = {
    "s4": ("configuration_s4", "S4Config"),
    "moe": ("configuration_moe", "MoEConfig"),
}


@functools.cache
def config_fields(family: str) -> tuple[str, ...]:
    """The fields a family's config class declares (its annotated class attributes), read from the source file
    without importing it, so recipes are checked without importing torch. Inherited `PreTrainedConfig` fields are
    not included: recipes do not set them."""
    module, cls = FAMILIES[family]
    tree = ast.parse((Path(__file__).parents[1] / "models" / f"{module}.py").read_text())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls).body
    return tuple(n.target.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
