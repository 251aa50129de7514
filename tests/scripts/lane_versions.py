"""Print which versions of the libraries s4accel depends on this environment holds, on one line (the lanes' header).

    python tests/scripts/lane_versions.py LABEL
"""

import sys
from importlib.metadata import PackageNotFoundError, version

LIBRARIES = ("torch", "transformers", "accelerate", "datasets", "huggingface_hub", "tokenizers", "safetensors",
             "pydantic", "typer")


def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"


print(f"{sys.argv[1]}: " + ", ".join(f"{name} {installed(name)}" for name in LIBRARIES), flush=True)
